"""One instance's fast-forward context: whether its jumps are on, what the simulation tells it about its arrivals
and hand-offs, the jump under way, and the jumps' counters (lab/engine/jump/ plans and applies the jumps).

The simulation configures it through its methods (:meth:`JumpContext.disable`, :meth:`ends_at_hand_offs`,
:meth:`ends_at_completions`, :meth:`expects_arrivals`, :meth:`stops_at`); the instance's loop asks it for a jump
(:meth:`plan`) and runs it (:meth:`run`); an arrival or a router's read brings a jump under way up to date
(:meth:`materialize`) exactly where step-by-step simulation would be.
"""

from __future__ import annotations

from typing import Callable

import simpy

from lab.core.kv_cache import unique_content
from lab.core.request import Request
from lab.core.step import ScheduledStep
from lab.engine import jump as ff
from lab.engine.window import delay_until


class JumpContext:
    """The fast-forward state of one instance (``Instance.jump``).

    Args:
        inst: the instance (lab/engine/instance.py ``Instance``).
        enabled: jumps are allowed (``EngineOptions.fast_forward``, a scheduler with ``supports_fast_forward``, one
            pipeline stage, its own loop, no drafts).

    Attributes:
        steady: the last schedule (real or planned) showed the waiting head blocked and nothing changed since: a
            jump need not check its first schedule (else the scheduler's admission decision checks it).
        known_arrivals: the requests an open-loop stream will deliver here, in order, when known in advance (a
            jump may then plan their admissions), or None.
        arrival_hint: the expected time of the next arrival (seconds; sizes plans, never changes results).
        all_content_unique: every request that reached the instance has content unique to it (none of its blocks
            can be hit), so a jump need not check them one by one.
        num_jumps, jumped_steps, num_absorbed_arrivals, num_planned_admissions: counters (reports and tests).
    """

    def __init__(self, inst, enabled: bool) -> None:
        self.inst = inst
        self.enabled = enabled
        self.steady = False
        self.stop_time = float("inf")  # jumps end before it (the horizon)
        self.finish_triggers_arrival = False  # a completion causes an arrival at its instant (closed loop)
        self.hands_off = False  # requests leave for another pool at their own instant
        self.arrival_hint: Callable[[], float] = lambda: float("inf")
        self.known_arrivals: ff.KnownArrivals | None = None
        self.all_content_unique = True
        self.plan_under_way: ff.Plan | None = None
        self._cont: tuple | None = None  # where a materialised jump leaves the window
        self._last_arrival = 0.0
        self._gap_ema = 0.0
        self.num_jumps = 0
        self.jumped_steps = 0
        self.num_absorbed_arrivals = 0  # arrivals queued behind a blocked head during a jump, which went on
        self.num_planned_admissions = 0  # arrivals a jump admitted (known in advance)

    # ---- configuration (lab/experiment/simulation.py) ----
    def disable(self) -> None:
        """Run the instance step by step, whatever its options say."""
        self.enabled = False

    def stops_at(self, stop_time: float) -> None:
        """Jumps end before ``stop_time`` (seconds: the horizon)."""
        self.stop_time = stop_time

    def ends_at_hand_offs(self) -> None:
        """Its pool hands requests on: each hand-off happens at its own instant, so a jump ends right after the
        first one."""
        self.hands_off = True

    def ends_at_completions(self) -> None:
        """A completion may send the next request at its very instant (closed-loop clients): jumps end at the
        first completion, sized by the expected next arrival."""
        self.finish_triggers_arrival = True
        self.arrival_hint = self.expected_next_arrival

    def expects_arrivals(self, hint: Callable[[], float], known: ff.KnownArrivals | None = None) -> None:
        """The exact time of the next arrival (``hint``) and, when the stream is known in advance, its requests."""
        self.arrival_hint = hint
        if known is not None:
            self.known_arrivals = known

    # ---- arrivals ----
    def note_arrival(self, request: Request, now: float) -> None:
        """An arrival at ``now`` (seconds): the gap estimate behind :meth:`expected_next_arrival`."""
        gap = now - self._last_arrival
        self._gap_ema = gap if not self._gap_ema else 0.8 * self._gap_ema + 0.2 * gap
        self._last_arrival = now

    def taken_over(self, request: Request) -> None:
        """A request reached the instance (an arrival or a hand-off)."""
        if self.all_content_unique and not unique_content(request):
            self.all_content_unique = False

    def expected_next_arrival(self) -> float:
        """When the next request is expected here: now plus the mean recent gap between arrivals (the expected wait
        of a Poisson stream, whatever has elapsed). Only sizes plans; an arrival at any other time is still
        handled exactly."""
        if not self._gap_ema:
            return float("inf")
        return self.inst.now + self._gap_ema

    def planned_admission(self, request: Request) -> bool:
        """Whether ``request``, arriving now from the known stream, is one the jump under way admits (it then just
        joins the queue); a request that is not the stream's next ends planning through arrivals."""
        known = self.known_arrivals
        if known is not None and known.peek() is not request:
            known = self.known_arrivals = None  # not the stream it was given: no more planned admissions
        if known is None:
            return False
        known.next += 1
        p = self.plan_under_way
        return p is not None and ff.planned_arrival(p, request)

    def before_arrival(self) -> bool:
        """Bring a jump under way up to date for an arrival; True when the arrival falls in the jump's last step
        and is counted there instead."""
        p = self.plan_under_way
        self.steady = False
        if p is not None:
            if self.inst.env.now > (p.start if p.num_schedules == 1 else p.ends_list[p.num_schedules - 2]):
                # It arrives during the jump's last step, whose schedule is already made: nothing before the jump
                # ends can see it, so the jump runs to its end (the step records count it as waiting).
                p.deferred_arrivals += 1
                return True
            self.materialize()
        return False

    def uncount_deferred(self) -> None:
        """An arrival :meth:`before_arrival` counted in the jump's last step does not wait after all (rejected, or
        waiting for its remote KV)."""
        self.plan_under_way.deferred_arrivals -= 1  # type: ignore[union-attr]

    def blocked_head(self) -> Request | None:
        """The waiting head the last schedule showed blocked (steady state with requests waiting), or None. An
        arrival queued behind it changes no schedule of the jump under way (one that only decodes until a
        completion, or one through the heads' admissions of an FCFS queue, which it joins behind all of them), so
        it need not end the jump nor make the next step a real one (:meth:`queued_behind`)."""
        waiting = self.inst.waiting
        if self.enabled and self.steady and waiting:
            p = self.plan_under_way
            if p is not None and p.admissions and not p.from_queue:
                return None  # the queue holds arrivals the jump admits, not a blocked head
            return waiting.peek()
        return None

    def queued_behind(self, head: Request) -> None:
        """An arrival joined the queue while ``head`` was blocked: if the head is still the same (and the queue's
        order stays put until the jump under way ends), count it in the jump (``jump.absorb_arrival``) and stay
        steady; otherwise bring the jump up to date as for any arrival."""
        waiting = self.inst.waiting
        if waiting.peek() is head:
            p = self.plan_under_way
            if p is None:
                return
            if ff.absorb_arrival(p, self.inst.env.now, waiting.order_stable_until()):
                self.num_absorbed_arrivals += 1
                return
        self.before_arrival()

    def shows_steady(self, out, reqs: list[Request], news: list[int], samples: list[bool], admitted: int) -> bool:
        """Whether a real schedule shows the waiting queue blocked for the decode steps that follow: it preempted
        nothing and ran every running request, and either only decoded and admitted nothing (``admitted``), or
        ended with the waiting head blocked by KV or ``max_num_seqs`` (``SchedulerOutput.waiting_blocked``) while
        every request samples (any prompt it admitted or continued ends in this step)."""
        running = self.inst.running
        if out.preempted or len(reqs) != len(running) or reqs != running:
            return False
        if news.count(1) == len(news) and not admitted:
            return True
        return out.waiting_blocked and all(samples)

    # ---- jumps ----
    def plan(self) -> tuple[ff.Plan, ScheduledStep | None] | None:
        """A plan from now (and the step in flight it absorbs under async), or None."""
        inst = self.inst
        window = inst.window
        first = window.oldest if window.steps else None
        stop = self.stop_time
        if inst.waiting:
            stop = min(stop, inst.waiting.order_stable_until())  # a jump ends before the waiting order can change
        check_head = not self.steady  # the admission decision says whether schedule 0 leaves the head blocked
        p = ff.plan(inst, stop, first, check_head)
        if p is None:
            return None
        if check_head:
            self.steady = True  # every schedule of the jump leaves the head blocked
        return p, first

    def run(self, p: ff.Plan, first: ScheduledStep | None):
        """Run one jump; yields SimPy events. Leaves the window as step-by-step simulation would."""
        inst = self.inst
        window = inst.window
        if first is not None:
            window.pop_oldest()
        self.plan_under_way = p
        self.num_jumps += 1
        env = inst.env
        try:
            yield env.timeout(delay_until(env.now, p.ends_list[-1]))
        except simpy.Interrupt:
            step, start, nxt = self._cont  # type: ignore[misc]
            self._cont = None
            self.jumped_steps += p.applied_out
            if step is not None:
                window.resume(step, start)
                window.pop_oldest()
                yield env.timeout(delay_until(env.now, step.end))
                inst.finish_step(step)
            if nxt is not None:
                window.resume(nxt, step.end if step is not None else p.ends_list[-1])
            return
        self.plan_under_way = None
        inst.clock = p.ends_list[-1]
        ff.apply(inst, p, p.num_schedules, p.num_schedules)
        if p.deferred_arrivals:
            inst.steps.add_waiting(p.deferred_arrivals)
        self.jumped_steps += p.num_schedules
        if p.async_:
            window.resume(ff.step_for(p, p.num_schedules - 1), inst.clock)

    def materialize(self) -> None:
        """If a jump is under way, apply every step it has completed by now and turn the step executing now into
        an ordinary in-flight step, so the instance's state reads exactly as step-by-step simulation's."""
        p = self.plan_under_way
        if p is None:
            return
        self.plan_under_way = None
        n_sched, n_out, q = ff.progress_at(p, self.inst.env.now)
        ff.apply(self.inst, p, n_sched, n_out)
        if n_out >= p.num_schedules:  # the jump is complete at this very instant
            self._cont = (None, None, ff.step_for(p, p.num_schedules - 1) if p.async_ else None)
        elif p.async_:
            step = p.first if q == 0 else ff.step_for(p, q - 1)
            start = p.start if q == 0 else p.ends_list[q - 1]
            self._cont = (step, start, ff.step_for(p, q))
        else:
            step = ff.step_for(p, q)
            self._cont = (step, p.start if q == 0 else p.ends_list[q - 1], None)
        self.inst.process.interrupt()
