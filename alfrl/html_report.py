"""``alfrl report ... --html``: one self-contained page to read what the agent did.

The page (``report.html`` beside ``report.md``) holds the run table, the charts (inlined PNG), every
evaluated game with filters (split, task type, won / lost, stop reason, run), and a game's trajectory
turn by turn: the observation, the model's completion with its reasoning and its action shown apart,
whether the action was well formed and admissible, the environment's answer, tokens per turn; with
two runs, the same game side by side, aligned by turn. Repeated actions are highlighted (loops) and a
trajectory that ran out of token budget says so. Training rollouts (``data.save_rollouts``) show each
trajectory's reward, its group's rewards and its advantage (reward - group mean).

No server and no network: inline CSS and JavaScript, the data as one JSON block in which every
distinct text is stored once (loops repeat the same observations), and only the selected game is
drawn, so 274 games x 2 runs stay a few MB. ``report.html#run=0&other=1&game=ID`` opens a game directly
(``&group=G&index=I``: a training trajectory; the address bar and each game's "link" give it), what
``bench/html_screenshot.sh`` photographs.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_completion(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a completion: the ``<think>`` block, or the text before a tool call."""
    m = _THINK.search(text)
    if m:
        return m.group(1).strip(), (text[: m.start()] + text[m.end() :]).strip()
    cut = text.find("<tool_call>")
    if cut > 0:
        return text[:cut].strip(), text[cut:].strip()
    return "", text.strip()


class _Strings:
    """A table of distinct texts: each stored once, referenced by index."""

    def __init__(self):
        self.index: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, text: str) -> int:
        if text not in self.index:
            self.index[text] = len(self.values)
            self.values.append(text)
        return self.index[text]


def _game(rec: dict, s: _Strings, extra: dict | None = None) -> dict:
    turns = []
    for t in rec["turns"]:
        think, rest = split_completion(t["completion_text"])
        turns.append([s(think), s(rest), s(t.get("action") or ""), int(bool(t["valid_format"])), int(bool(t["admissible"])),
                      s(t["status"]), s(t["observation"]), t["prompt_tokens"], t["completion_tokens"], s(t.get("format_error") or "")])
    game = {"id": rec["game_id"], "split": rec["split"], "task_type": rec["task_type"], "task": rec.get("task", ""), "won": bool(rec["won"]),
            "stop": rec["stop_reason"], "reward": rec["reward"], "invalid": rec["invalid_actions"], "turns": turns,
            "first": s(rec["turns"][0]["observation_before"]) if rec["turns"] else s("")}
    if extra:
        game.update(extra)
    return game


def rollout_games(path: Path, s: _Strings) -> list[dict]:
    """Training trajectories written by ``data.save_rollouts``, with group rewards and advantages."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups: dict[int, list[float]] = {}
    for r in records:
        groups.setdefault(r.get("group", 0), []).append(r["reward"])
    out = []
    for r in records:
        rewards = groups[r.get("group", 0)]
        mean = sum(rewards) / len(rewards)
        out.append(_game(r, s, {"group": r.get("group", 0), "index": r.get("index", 0), "group_rewards": rewards,
                                "advantage": r["reward"] - mean}))
    return out


def build_page(runs: list[tuple[str, list[dict]]], table_md: str, images: list[Path], rollouts: list[tuple[str, Path]] = ()) -> str:
    """The page for ``runs`` ((name, game records) from ``alfrl eval`` files) and training rollout files."""
    s = _Strings()
    data = {"runs": [{"name": name, "games": [_game(r, s) for r in games]} for name, games in runs]}
    for name, path in rollouts:
        data["runs"].append({"name": name, "games": rollout_games(Path(path), s), "training": True})
    data["strings"] = s.values
    pictures = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for p in images if p.is_file())
    parts = {"TABLE": _markdown_tables(table_md), "CHARTS": pictures, "DATA": script_safe_json(data)}
    # one pass: a value that holds %DATA% (a run named so) is not itself searched again
    return re.sub(r"%(TABLE|CHARTS|DATA)%", lambda m: parts[m.group(1)], _PAGE)


SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
"""Characters that JSON may hold as they are but an HTML script block may not: ``<`` and ``>`` (``</script``, ``<!--``
and ``<script`` change how the block is parsed), ``&``, and the line separators some JavaScript parsers end a line at."""


def script_safe_json(data) -> str:
    """``data`` as JSON that a ``<script type="application/json">`` block holds verbatim, whatever its strings contain
    (the same value for JSON.parse: each unsafe character is written as its \\u escape)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return re.sub("[<>&\u2028\u2029]", lambda m: SCRIPT_UNSAFE[m.group(0)], text)


def _markdown_tables(md: str) -> str:
    """report.md's headings, paragraphs and pipe tables as HTML (enough for alfrl's own report)."""
    out, rows = [], []

    def flush():
        if rows:
            head, body = rows[0], [r for r in rows[2:]]
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body) + "</table>")
            rows.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        flush()
        if line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")) + 1, 4)
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


_PAGE = r"""<!doctype html><html><head><meta charset="utf-8"><title>alfrl report</title><style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}header{padding:8px 16px;background:#24292f;color:#fff}
main{display:flex;height:calc(100vh - 40px)}#left{width:30%;overflow:auto;border-right:1px solid #ccc;padding:8px}
#right{flex:1;overflow:auto;padding:8px}table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 6px}
details{margin:8px 16px}figure{display:inline-block;margin:4px}figure img{max-width:480px}
.filters select{margin:2px}.game{cursor:pointer;padding:2px 4px;border-bottom:1px solid #eee}.game:hover{background:#eef}
.won{color:#1a7f37}.lost{color:#cf222e}.cols{display:flex;gap:8px}.col{flex:1;min-width:0}
.turn{border:1px solid #ddd;border-radius:4px;margin:4px 0;padding:4px}.turn.bad{background:#fff5f5}.turn.loop{border-left:4px solid #d4a72c}
.think{color:#57606a;font-style:italic;white-space:pre-wrap}.act{font-weight:600}.obs{white-space:pre-wrap;color:#0a3069}
.meta{font-size:12px;color:#57606a}.tag{display:inline-block;padding:0 4px;border-radius:3px;font-size:11px;margin-right:4px}
.ok{background:#dafbe1}.no{background:#ffebe9}.budget{background:#fff8c5;padding:4px;margin:4px 0}
</style></head><body><header>alfrl report: runs, games and trajectories</header>
<details><summary>Runs and charts</summary>%TABLE%<div>%CHARTS%</div></details>
<main><div id="left"><div class="filters">
<select id="run"></select><select id="split"><option value="">every split</option></select>
<select id="task"><option value="">every task type</option></select>
<select id="outcome"><option value="">won and lost</option><option value="won">won</option><option value="lost">lost</option></select>
<select id="stop"><option value="">every stop reason</option></select>
<select id="other"><option value="">no second run</option></select></div>
<div id="count" class="meta"></div><div id="list"></div></div><div id="right"><p class="meta">Pick a game on the left.</p></div></main>
<script id="data" type="application/json">%DATA%</script><script>
const D=JSON.parse(document.getElementById('data').textContent),S=D.strings,$=id=>document.getElementById(id);
const esc=t=>String(t??'').replace(/[&<>"']/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));
const num=(x,d)=>Number.isFinite(Number(x))?Number(x).toFixed(d):esc(x);
function fill(sel,values){for(const v of values){const o=document.createElement('option');o.value=v;o.textContent=v;sel.appendChild(o);}}
D.runs.forEach((r,i)=>{for(const id of ['run','other']){const o=document.createElement('option');o.value=i;o.textContent=r.name+(r.training?' (training)':'');$(id).appendChild(o);}});
const all=D.runs.flatMap(r=>r.games);fill($('split'),[...new Set(all.map(g=>g.split))].sort());
fill($('task'),[...new Set(all.map(g=>g.task_type))].sort());fill($('stop'),[...new Set(all.map(g=>g.stop))].sort());
function key(g){return g.id+(g.group!==undefined?'#'+g.group+'.'+g.index:'');}
function traj(g){return `group ${esc(g.group)}, trajectory ${Number.isInteger(g.index)?g.index+1:esc(g.index)} of ${g.group_rewards.length}`;}
function link(g){const q=new URLSearchParams({run:$('run').value});if($('other').value!=='')q.set('other',$('other').value);q.set('game',g.id);
if(g.group!==undefined){q.set('group',g.group);q.set('index',g.index);}return '#'+q.toString();}
function list(){const r=D.runs[+$('run').value],f={split:$('split').value,task:$('task').value,o:$('outcome').value,stop:$('stop').value};
const gs=r.games.filter(g=>(!f.split||g.split==f.split)&&(!f.task||g.task_type==f.task)&&(!f.o||(f.o=='won')==g.won)&&(!f.stop||g.stop==f.stop));
$('count').textContent=gs.length+' of '+r.games.length+' games';
$('list').innerHTML=gs.map((g,i)=>`<div class="game" data-k="${esc(key(g))}"><span class="${g.won?'won':'lost'}">${g.won?'won':'lost'}</span> ${esc(g.id)} <span class="meta">${g.group_rewards?traj(g)+', reward '+num(g.reward,2)+', adv '+num(g.advantage,3)+', ':''}${g.turns.length} turns, ${esc(g.stop)}</span></div>`).join('');
for(const el of document.querySelectorAll('.game'))el.onclick=()=>show(el.dataset.k);}
function turns(g){const seen={},out=[];
for(const [i,t] of g.turns.entries()){const act=S[t[2]],loop=act&&seen[act]!==undefined;if(act&&!loop)seen[act]=i;out.push({t,i,loop,first:loop?seen[act]:null});}return out;}
function head(g){if(!g)return '<p class="meta">not played in this run</p>';
let h=`<h3 class="${g.won?'won':'lost'}">${g.won?'won':'lost'}: ${esc(g.task||'')}</h3><div class="meta">${esc(g.id)} | ${esc(g.task_type)} | stop: ${esc(g.stop)} | reward ${num(g.reward,2)} | invalid actions ${esc(g.invalid)}</div>`;
if(g.group_rewards)h+=`<div class="meta">${traj(g)}: reward ${num(g.reward,2)}, advantage ${num(g.advantage,3)}; group rewards [${g.group_rewards.map(x=>num(x,2)).join(', ')}]</div>`;
return h+`<div class="meta"><a href="${esc(link(g))}">link to this ${g.group_rewards?'trajectory':'game'}</a></div><div class="obs">${esc(S[g.first])}</div>`;}
function body(g){if(!g)return [];const out=[];
for(const {t,i,loop,first} of turns(g)){
let h=`<div class="turn${t[3]&&t[4]?'':' bad'}${loop?' loop':''}"><div class="meta">turn ${i+1} | prompt ${esc(t[7])} tokens, completion ${esc(t[8])} | <span class="tag ${t[3]?'ok':'no'}">${t[3]?'well formed':'bad format'}</span><span class="tag ${t[4]?'ok':'no'}">${t[4]?'admissible':'not admissible'}</span>${loop?'<span class="tag no">repeats turn '+(first+1)+'</span>':''}${S[t[9]]?' '+esc(S[t[9]]):''}</div>`;
if(S[t[0]])h+=`<div class="think">${esc(S[t[0]])}</div>`;
h+=`<div class="act">${esc(S[t[2]]||S[t[1]])}</div><div class="meta">${esc(S[t[5]])}</div><div class="obs">${esc(S[t[6]])}</div></div>`;out.push(h);}
if(g.stop=='trajectory_too_long')out.push('<div class="budget">The token budget ran out here: the next prompt would not have fit.</div>');return out;}
function show(k){const a=D.runs[+$('run').value].games.find(g=>key(g)==k),o=$('other').value;
if(a&&typeof history!=='undefined'&&history.replaceState)history.replaceState(null,'',link(a));  // the address bar links here
if(o===''){$('right').innerHTML=head(a)+body(a).join('');return;}const b=D.runs[+o].games.find(g=>key(g)==k);
const A=body(a),B=body(b);let rows='';for(let i=0;i<Math.max(A.length,B.length);i++)rows+=`<div class="cols"><div class="col">${A[i]||''}</div><div class="col">${B[i]||''}</div></div>`;
$('right').innerHTML=`<div class="cols"><div class="col"><h4>${esc(D.runs[+$('run').value].name)}</h4>${head(a)}</div><div class="col"><h4>${esc(D.runs[+o].name)}</h4>${head(b)}</div></div>`+rows;}
for(const id of ['run','split','task','outcome','stop'])$(id).onchange=list;
const q=new URLSearchParams(location.hash.slice(1));for(const id of ['run','other','split','task','outcome','stop'])if(q.has(id))$(id).value=q.get(id);
list();if(q.has('game'))show(q.get('game')+(q.has('group')?'#'+q.get('group')+'.'+q.get('index'):''));
</script></body></html>"""
