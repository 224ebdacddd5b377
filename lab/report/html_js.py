"""The CSS and JavaScript inlined in every ``report.html`` / ``sweep.html`` (lab/report/html.py).

A small chart renderer of our own, so that a report opens from disk with no server, no network and no library:
line charts (with confidence bands, horizontal threshold lines and a hover readout), a Gantt-like request timeline
and sortable tables. The page's data is one JSON object in ``<script type="application/json" id="servelab-data">``
(``charts``: id -> line-chart spec, ``gantts``: id -> timeline spec). Every drawn data element carries the class
``mark``, so a test can tell a plot with data from an empty one. SVG is built as markup and parsed by the HTML
parser, which puts it in the SVG namespace without naming it.
"""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1280px;padding:0 18px 40px;color:#222}
h1{font-size:22px;margin:18px 0 6px}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
p.note{color:#555;font-size:13px;margin:4px 0 8px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right;white-space:nowrap}
th{background:#f4f4f4;cursor:pointer;user-select:none}td.l,th.l{text-align:left}
.scroll{overflow-x:auto}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:10px 18px}
.grid4{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:10px 14px}
figure{margin:0}figcaption{font-weight:600;font-size:13px;margin:2px 0}
.chart,.gantt{width:100%;min-height:40px;position:relative}
.readout{font:12px ui-monospace,Menlo,Consolas,monospace;color:#333;min-height:16px;white-space:pre-wrap}
.legend{font-size:12px;margin:2px 0 0}.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:14px;height:9px;margin-right:4px;vertical-align:middle;border-radius:2px}
svg text{font:11px system-ui,sans-serif;fill:#333}svg .axis{stroke:#888}svg .gridl{stroke:#eee}
svg .slo{stroke:#c00;stroke-dasharray:6 4;stroke-width:1.5}svg .cursor{stroke:#999;stroke-dasharray:2 2}
p.empty{color:#a00}
"""

JS = r"""
(function(){
"use strict";
var D=JSON.parse(document.getElementById("servelab-data").textContent);
var COLORS=["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f","#bcbd22","#17becf"];
function esc(s){return String(s).replace(/[&<>"]/g,function(c){return {"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c];});}
function fmt(v){if(v===null||v===undefined||!isFinite(v))return "-";var a=Math.abs(v);if(a===0)return "0";
  if(a>=1e6||a<1e-3)return v.toExponential(2);return String(+v.toPrecision(4));}
function ticks(lo,hi,n){if(!(hi>lo)){hi=lo+1;}var raw=(hi-lo)/n,mag=Math.pow(10,Math.floor(Math.log10(raw))),f=raw/mag;
  var step=(f<1.5?1:f<3?2:f<7?5:10)*mag,out=[];for(var v=Math.ceil(lo/step)*step;v<=hi+step*1e-9;v+=step)out.push(+v.toPrecision(12));return out;}
function extent(vals){var lo=Infinity,hi=-Infinity;for(var i=0;i<vals.length;i++){var v=vals[i];if(v===null||!isFinite(v))continue;if(v<lo)lo=v;if(v>hi)hi=v;}return [lo,hi];}
function legend(items){return '<div class="legend">'+items.map(function(it){return '<span><i style="background:'+it[1]+'"></i>'+esc(it[0])+'</span>';}).join("")+'</div>';}
function logTicks(a,b){var out=[],fs=b-a<1.2?[1,2,5]:b-a<2.5?[1,3]:[1];for(var k=Math.floor(a);k<=Math.ceil(b);k++){fs.forEach(function(f){
  var v=f*Math.pow(10,k),l=Math.log10(v);if(l>=a-1e-9&&l<=b+1e-9)out.push(+v.toPrecision(6));});}return out;}
function tickFmt(ts){if(ts.length<2)return fmt;var st=Infinity;for(var i=1;i<ts.length;i++)st=Math.min(st,ts[i]-ts[i-1]);
  var d=Math.max(0,Math.ceil(-Math.log10(st)-1e-9));if(d>6)return fmt;return function(v){var a=Math.abs(v);return a>=1e6?v.toExponential(1):v.toFixed(a>=1&&st>=1?0:d);};}
function nearest(xs,x){var lo=0,hi=xs.length-1;if(hi<0)return -1;while(hi-lo>1){var mid=(lo+hi)>>1;if(xs[mid]<x)lo=mid;else hi=mid;}
  return Math.abs(xs[lo]-x)<=Math.abs(xs[hi]-x)?lo:hi;}

function lineChart(el,spec){
  var W=Math.max(el.clientWidth,280),H=spec.height||240,m={l:62,r:14,t:10,b:38},iw=W-m.l-m.r,ih=H-m.t-m.b;
  var xs=[],ys=[];
  spec.series.forEach(function(s){for(var i=0;i<s.x.length;i++){if(s.y[i]===null)continue;xs.push(s.x[i]);ys.push(s.y[i]);
    if(s.lo&&s.lo[i]!==null){ys.push(s.lo[i]);ys.push(s.hi[i]);}}});
  if(!xs.length){el.innerHTML='<p class="empty">no data</p>';return;}
  (spec.hlines||[]).forEach(function(h){ys.push(h.y);});(spec.vlines||[]).forEach(function(h){xs.push(h.x);});
  var lg=!!spec.xlog&&extent(xs)[0]>0;var T=lg?function(v){return Math.log10(v);}:function(v){return v;};
  var xe=extent(xs.map(T)),ye=extent(ys);
  if(spec.xcats){xe=[-0.3,spec.xcats.length-0.7];}
  var y0=spec.ymin!==undefined?spec.ymin:Math.min(0,ye[0]),y1=spec.ymax!==undefined?spec.ymax:ye[1]+(ye[1]-y0)*0.05;
  if(!(y1>y0))y1=y0+1;var x0=xe[0],x1=xe[1];if(!(x1>x0)){x0-=0.5;x1+=0.5;}
  if(spec.xpad&&!spec.xcats){var pad=(x1-x0)*spec.xpad;x0-=pad;x1+=pad;}
  function X(v){return m.l+(T(v)-x0)/(x1-x0)*iw;}function Y(v){return m.t+ih-(v-y0)/(y1-y0)*ih;}
  var g=[];
  var yt=ticks(y0,y1,5),yf=tickFmt(yt);yt.forEach(function(t){if(t<y0-1e-12||t>y1)return;g.push('<line class="gridl" x1="'+m.l+'" x2="'+(m.l+iw)+'" y1="'+Y(t)+'" y2="'+Y(t)+'"/>',
    '<text x="'+(m.l-5)+'" y="'+(Y(t)+4)+'" text-anchor="end">'+yf(t)+'</text>');});
  var xt=spec.xcats?spec.xcats.map(function(_,i){return i;}):lg?logTicks(x0,x1):ticks(x0,x1,Math.max(2,Math.floor(iw/80)));
  var xf=lg?fmt:tickFmt(xt);xt.forEach(function(t){if(T(t)<x0-1e-12||T(t)>x1+1e-12)return;var lab=spec.xcats?spec.xcats[t]:xf(t);
    g.push('<line class="gridl" y1="'+m.t+'" y2="'+(m.t+ih)+'" x1="'+X(t)+'" x2="'+X(t)+'"/>',
    '<text x="'+X(t)+'" y="'+(m.t+ih+14)+'" text-anchor="middle">'+esc(lab)+'</text>');});
  g.push('<line class="axis" x1="'+m.l+'" x2="'+(m.l+iw)+'" y1="'+(m.t+ih)+'" y2="'+(m.t+ih)+'"/>',
    '<line class="axis" x1="'+m.l+'" x2="'+m.l+'" y1="'+m.t+'" y2="'+(m.t+ih)+'"/>',
    '<text x="'+(m.l+iw/2)+'" y="'+(H-4)+'" text-anchor="middle">'+esc(spec.xlabel||"")+'</text>',
    '<text transform="translate(12,'+(m.t+ih/2)+') rotate(-90)" text-anchor="middle">'+esc(spec.ylabel||"")+'</text>');
  var items=[];
  spec.series.forEach(function(s,k){var c=s.color||COLORS[k%COLORS.length];items.push([s.name,c]);
    if(s.lo){var up=[],dn=[];for(var i=0;i<s.x.length;i++){if(s.lo[i]===null||s.hi[i]===null)continue;up.push(X(s.x[i]).toFixed(1)+","+Y(s.hi[i]).toFixed(1));dn.unshift(X(s.x[i]).toFixed(1)+","+Y(s.lo[i]).toFixed(1));}
      if(up.length>1)g.push('<path class="mark band" d="M'+up.concat(dn).join("L")+'Z" fill="'+c+'" fill-opacity="0.18" stroke="none"/>');}
    var d=[];for(var i=0;i<s.x.length;i++){if(s.y[i]===null)continue;d.push(X(s.x[i]).toFixed(1)+","+Y(s.y[i]).toFixed(1));}
    if(d.length>1)g.push('<path class="mark line" d="M'+d.join("L")+'" fill="none" stroke="'+c+'" stroke-width="1.6"/>');
    if(s.points||d.length===1)d.forEach(function(p){var q=p.split(",");g.push('<circle class="mark" cx="'+q[0]+'" cy="'+q[1]+'" r="3" fill="'+c+'"/>');});});
  (spec.hlines||[]).forEach(function(h){g.push('<line class="slo" x1="'+m.l+'" x2="'+(m.l+iw)+'" y1="'+Y(h.y)+'" y2="'+Y(h.y)+'"/>',
    '<text x="'+(m.l+iw-4)+'" y="'+(Y(h.y)-4)+'" text-anchor="end" style="fill:#c00">'+esc(h.label)+'</text>');});
  (spec.vlines||[]).forEach(function(h){g.push('<line class="slo" y1="'+m.t+'" y2="'+(m.t+ih)+'" x1="'+X(h.x)+'" x2="'+X(h.x)+'"/>');});
  (spec.hlines||[]).concat(spec.vlines||[]).forEach(function(h){items.push([h.label,"#c00"]);});
  g.push('<line class="cursor" y1="'+m.t+'" y2="'+(m.t+ih)+'" x1="-10" x2="-10"/>','<rect class="hover" x="'+m.l+'" y="'+m.t+'" width="'+iw+'" height="'+ih+'" fill="transparent"/>');
  el.innerHTML='<svg width="'+W+'" height="'+H+'" role="img">'+g.join("")+'</svg>'+(items.length>1||spec.hlines||spec.vlines?legend(items):"")+'<div class="readout">&nbsp;</div>';
  var svg=el.querySelector("svg"),cur=svg.querySelector(".cursor"),out=el.querySelector(".readout");
  svg.querySelector(".hover").addEventListener("mousemove",function(ev){var r=svg.getBoundingClientRect(),xv=x0+(ev.clientX-r.left-m.l)/iw*(x1-x0);
    if(lg)xv=Math.pow(10,xv);
    var parts=[],at=null;spec.series.forEach(function(s){var i=nearest(s.x,xv);if(i<0||s.y[i]===null)return;at=s.x[i];
      parts.push(s.name+" "+fmt(s.y[i])+(s.lo&&s.lo[i]!==null?" ["+fmt(s.lo[i])+", "+fmt(s.hi[i])+"]":""));});
    if(at===null)return;cur.setAttribute("x1",X(at));cur.setAttribute("x2",X(at));
    out.textContent=(spec.xlabel||"x")+" = "+(spec.xcats?spec.xcats[at]:fmt(at))+":  "+parts.join(";  ");});
}

var KIND={frontend:["front end (API server)","#ffbb78"],queued:["queued","#c7c7c7"],prefill:["prefill","#1f77b4"],decode:["decode","#2ca02c"],
  preempted:["preempted (gap)","#d62728"],transfer:["hand-off / KV transfer","#9467bd"],chunk:["step with prefill tokens","#0b3d66"]};
var MARK={swap_out:["swap-out","#ff7f0e"],swap_in:["swap-in","#17becf"],recompute:["resume by recompute","#8c564b"],rejected:["rejected","#000"]};
function gantt(el,spec){
  var rows=spec.rows;if(!rows.length){el.innerHTML='<p class="empty">no data</p>';return;}
  var W=Math.max(el.clientWidth,320),rh=15,m={l:96,r:14,t:8,b:34},iw=W-m.l-m.r,H=m.t+m.b+rows.length*rh;
  var x0=spec.t0,x1=spec.t1;if(!(x1>x0))x1=x0+1;function X(v){return m.l+(v-x0)/(x1-x0)*iw;}
  var g=[],gt=ticks(x0,x1,Math.max(2,Math.floor(iw/90))),gf=tickFmt(gt);gt.forEach(function(t){if(t<x0||t>x1)return;
    g.push('<line class="gridl" y1="'+m.t+'" y2="'+(H-m.b)+'" x1="'+X(t)+'" x2="'+X(t)+'"/>','<text x="'+X(t)+'" y="'+(H-m.b+14)+'" text-anchor="middle">'+gf(t)+'</text>');});
  g.push('<text x="'+(m.l+iw/2)+'" y="'+(H-4)+'" text-anchor="middle">time (s)</text>');
  rows.forEach(function(r,k){var y=m.t+k*rh;g.push('<text x="'+(m.l-5)+'" y="'+(y+rh-4)+'" text-anchor="end">'+esc(r.label)+'</text>');
    r.segs.forEach(function(s){var a=X(s[0]),w=Math.max(X(s[1])-a,1),c=KIND[s[2]][1],h=s[2]==="chunk"?5:rh-3,yy=s[2]==="chunk"?y+rh-7:y+1;
      g.push('<rect class="mark seg" x="'+a.toFixed(2)+'" y="'+yy+'" width="'+w.toFixed(2)+'" height="'+h+'" fill="'+c+'" data-tip="'+esc(r.label+": "+s[3])+'"><title>'+esc(s[3])+'</title></rect>');});
    r.marks.forEach(function(p){var a=X(p[0]),c=MARK[p[1]][1],yc=y+rh/2,d=p[1]==="swap_in"||p[1]==="swap_out"?("M"+a+","+(yc-6)+"L"+(a+5)+","+yc+"L"+a+","+(yc+6)+"L"+(a-5)+","+yc+"Z"):("M"+(a-5)+","+(yc-6)+"L"+(a+5)+","+(yc-6)+"L"+a+","+(yc+6)+"Z");
      g.push('<path class="mark" d="'+d+'" fill="'+c+'" stroke="#fff" stroke-width="0.8" data-tip="'+esc(r.label+": "+p[2])+'"><title>'+esc(p[2])+'</title></path>');});});
  var items=Object.keys(KIND).map(function(k){return KIND[k];}).concat(Object.keys(MARK).map(function(k){return MARK[k];}));
  el.innerHTML='<svg width="'+W+'" height="'+H+'" role="img">'+g.join("")+'</svg>'+legend(items)+'<div class="readout">hover a bar for its detail</div>';
  var out=el.querySelector(".readout");el.querySelector("svg").addEventListener("mouseover",function(ev){var t=ev.target.getAttribute("data-tip");if(t)out.textContent=t;});
}

function sortable(tbl){var ths=tbl.querySelectorAll("th");ths.forEach(function(th,col){th.title="click to sort";th.addEventListener("click",function(){
  var body=tbl.tBodies[0],rows=Array.prototype.slice.call(body.rows),dir=th.getAttribute("data-dir")==="1"?-1:1;th.setAttribute("data-dir",dir===1?"1":"-1");
  rows.sort(function(a,b){var p=a.cells[col],q=b.cells[col],u=parseFloat(p.getAttribute("data-v")),v=parseFloat(q.getAttribute("data-v"));
    if(isFinite(u)&&isFinite(v))return (u-v)*dir;if(isFinite(u))return -1;if(isFinite(v))return 1;return p.textContent.localeCompare(q.textContent)*dir;});
  rows.forEach(function(r){body.appendChild(r);});});});}

function draw(){document.querySelectorAll("[data-chart]").forEach(function(el){lineChart(el,D.charts[el.getAttribute("data-chart")]);});
  document.querySelectorAll("[data-gantt]").forEach(function(el){gantt(el,D.gantts[el.getAttribute("data-gantt")]);});}
draw();document.querySelectorAll("table.sortable").forEach(sortable);
var pending=null;window.addEventListener("resize",function(){clearTimeout(pending);pending=setTimeout(draw,150);});
})();
"""
