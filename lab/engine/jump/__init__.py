"""Exact decode fast-forward: many decode steps advanced in one jump.

A stretch qualifies when every running request is decoding (one token per step) and the waiting queue is empty or
its head blocked: shown so by the last schedule, or, when something changed since (a completion, a preemption, an
arrival), by the scheduler's admission rule for the jump's first schedule. From then on each step schedules the
running requests that still have tokens to generate: request i takes part in the next ``rem_i`` schedules and
finishes at a known step, so the batch only shrinks, at known steps. Contexts grow by one token per step, so step
shapes and times are known in advance, and the KV block operations happen in a known order: a new block when a
context crosses a block boundary, a block's hash registered when it fills, a finished request's blocks freed
(last first) before the next schedule. The jump replays exactly these operations in that order and applies the
per-request counters and per-step records in bulk, so its results equal step-by-step simulation exactly
(tests/test_fastforward.py checks it on random workloads, clusters and horizons). Under async scheduling the jump
starts with the step in flight, which must run every request with each sampling at its end: a request whose last
prompt chunk is in it gets its first token there, and one that sat out the step before (re-computing its tokens
after a preemption, or back from swap) its next token, whose ITL sample runs from its previous token.

A jump stops before the first schedule after its first whose new blocks would exceed the free blocks (a
preemption; the blocks completions free count from the next schedule on), unless a walk through the queue plans
that preemption (below), and at the horizon. When requests are
waiting, a completion frees blocks and a ``max_num_seqs`` slot, so the next schedule may admit the waiting head:
the scheduler's declared admission rule (``decisions.head_stays_blocked``, given the running count, the next
schedule's decodes and its free blocks after their allocations) says whether the jump goes on through it; otherwise
(or for a policy that cannot tell) the jump ends right after that completion. An arrival during a jump materialises
the steps completed by then and the step under way continues normally. ``simulation.fast_forward: false`` turns it
off.

The overloaded regime (a long queue, KV or ``max_num_seqs`` full) adds these cases, all exact:

- The schedule that shows the queue blocked may be one that admitted requests or finished a prompt, when the
  policy reports that admission stopped at a request it could not take for KV or ``max_num_seqs``
  (``SchedulerOutput.waiting_blocked``) and every request samples: the next schedule then only decodes, with
  more budget, no more free blocks and no fewer running requests, so that request stays blocked until a
  completion (``Instance._shows_steady``).
- An arrival queued behind that blocked head changes no schedule of the jump (only the head is tried, and in a
  jump through the heads' admissions, FCFS only, the arrival waits behind every head the jump admits), so the
  jump goes on and counts it in the waiting column of the steps ending after it (:func:`absorb_arrival`); an
  arrival that becomes the head, or a queue whose order may change before the jump ends, materialises as before.
  With requests waiting, plans are therefore not cut at the expected next arrival.
- A real step that did not show the head blocked (it completed requests, preempted, or admitted) does not force
  the next step to be real either: the next plan checks its first schedule with the same admission rule
  (``check_head``; ``Instance.jump.steady`` says when it need not).
- A completion that lets the head in does not end the jump when the scheduler's declared rules say what the
  schedule after it does (:func:`through_queue`): it admits heads with their whole prompts
  (``decisions.admits_whole``) before one that stays blocked, or the last with a first chunk of its prompt
  (``admits_chunk``) whose next chunks come in the running phase of the schedules after (``running_chunk``). Each
  such schedule is planned as the engine prices it, and the next one is checked the same way (the budget is whole
  again). The jump ends at the first schedule whose decision is not certain, which is then a real one.
- A jump may start with a schedule whose decodes run out of KV blocks, when the scheduler declares how it then
  preempts (``SchedulerBase.decode_preemption_reason``: vLLM V1's ``last`` victim rule, recompute): the decodes
  take their blocks in running order, one that finds none free preempts the last running requests until it fits
  (:func:`_decode_victims`), and the schedule admits nothing. The victims then head the queue, and the walk through
  the queue checks the next schedule on. The jump's apply makes the preemptions at their place among schedule 0's
  block operations (:func:`preempt_planned`), so the blocks handed out are the engine's; a victim's token from
  the step in flight (async) is dropped, as the engine drops it.
- A later schedule of the walk whose decodes run out of KV blocks preempts the same way
  (:func:`walk_preemptions`, :meth:`_QueueWalk.preempt`): a victim, running at the jump's start or admitted by
  it, takes part in the schedules before that one only (its ``rem`` cut there; it completes in none), its blocks
  go back to the free order at their place among the decodes' takes, and it heads the queue with the state
  ``Instance.preempt`` leaves (its outputs so far), so the walk may resume it later in the same jump as another
  participant. The apply gives the victim its counters for the schedules before its preemption, then preempts it
  (:func:`preempt_planned`; the outputs of the steps before that schedule are applied first), and no later sync
  touches that participant; under async its token (or first sample) from the step in flight is dropped, in the
  step's row and the ITL samples as in the request. Such a walk ends instead when a victim would not be decoding
  in that schedule (its last token in flight), a prompt is part-way done, or nothing would be left to decode.
- Under prefix caching, a head preempted before (a victim of the jump's schedule 0, or one waiting at its start)
  may be resumed at a later schedule of the walk: its hit is what is left of its own freed full blocks, which
  depends on the free queue's order. The walk follows that order (:class:`FreeOrder`: blocks freed to the head
  are taken first, then the queue's blocks in order, then the runs freed to the tail; a head's run is found in the
  queue at the jump's start, :func:`_track_runs`, or is its victim's, appended by schedule 0), so the hit is
  exact; the applied admission looks it up again and raises if it differs.

With nothing waiting and the instance's arrivals known in advance (``Instance.jump.known_arrivals``: an open-loop stream
on one instance or behind round robin, no front end), a jump also goes on through arrivals (:func:`through_arrivals`):
the first schedule made after an arrival admits it when the scheduler's declared rule
(``decisions.admits_whole``) says it takes the request alone with its whole prompt; that step is priced as
``Instance.price_step`` prices it, and the request then decodes with the others. The arrival still comes at its time
and waits in the queue until the jump applies its admission (:func:`admit_planned`). The jump ends at the first
arrival that is not certain (another arrival for the same schedule, a prompt the budget would chunk, a full batch
or cache, content the prefix cache may hold, CPU work that would show); ``tests/test_fastforward.py`` checks these
jumps against step-by-step simulation too.
"""

from lab.engine.jump.applying import absorb_arrival, apply, plan_counts, progress_at, step_for
from lab.engine.jump.arrivals import KnownArrivals, planned_arrival
from lab.engine.jump.base import MAX_JUMP_STEPS, Plan, decode_times
from lab.engine.jump.core import plan, steady_batch

__all__ = ["MAX_JUMP_STEPS", "KnownArrivals", "Plan", "absorb_arrival", "apply", "decode_times", "plan", "plan_counts",
           "planned_arrival", "progress_at", "steady_batch", "step_for"]
