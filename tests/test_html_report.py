"""The self-contained HTML report, built from real evaluation and rollout records (tiny model), read without a browser."""

import json
import re

import pytest

from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.evaluation import EvalConfig, eval_games, run_eval
from alfrl.html_report import build_page, split_completion
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner
from tests.helpers import WalkthroughEngine, alfrl_here


def _data(page: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.DOTALL).group(1))


@pytest.fixture(scope="module")
def evals(data_dir, tiny_tokenizer, tiny_model_dir, tmp_path_factory):
    """Two evaluation files of the same 4 games: the experts' walkthroughs, and the tiny model."""
    from transformers import AutoModelForCausalLM

    from alfrl.engines import HFEngine

    out = tmp_path_factory.mktemp("evals")
    fmt = chat_format(tiny_tokenizer, "tool_call")
    cfg = EvalConfig(limit_per_split=2, max_episode_steps=6, max_trajectory_tokens=6000, max_assistant_tokens=40, games_per_chunk=1)
    games = eval_games(data_dir, cfg.splits, cfg.limit_per_split)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with EnvPool(num_workers=2) as pool:
        for name, engine in (("expert", WalkthroughEngine(fmt, games)), ("tiny", HFEngine(model, tiny_tokenizer.pad_token_id))):
            runner = RolloutRunner(engine, pool, fmt, cfg.rollout_config(RolloutConfig()), RewardConfig())
            run_eval(runner, games, cfg, out / f"{name}.jsonl", {"name": name})
    return out, games


def test_the_page_holds_every_game_turn_and_filter_and_nothing_from_the_network(evals, capfd):
    out, games = evals
    proc = alfrl_here(capfd, "report", str(out / "expert.jsonl"), str(out / "tiny.jsonl"), "--names", "expert", "tiny",
                      "--out", str(out / "report"), "--html")
    assert proc.returncode == 0, proc.stderr
    page = (out / "report" / "report.html").read_text()
    for control in ('id="run"', 'id="split"', 'id="task"', 'id="outcome"', 'id="stop"', 'id="other"'):
        assert control in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
    assert "data:image/png;base64," in page  # the charts, inlined
    data = _data(page)
    assert [r["name"] for r in data["runs"]] == ["expert", "tiny"]
    strings = data["strings"]
    for run, records in zip(data["runs"], ("expert", "tiny")):
        recorded = [json.loads(line) for line in (out / f"{records}.jsonl").read_text().splitlines() if '"type": "game"' in line]
        assert [g["id"] for g in run["games"]] == [g.id for g in games] == [r["game_id"] for r in recorded]
        for g, r in zip(run["games"], recorded):
            assert len(g["turns"]) == len(r["turns"]) and g["won"] == r["won"] and g["stop"] == r["stop_reason"]
            for t, rt in zip(g["turns"], r["turns"]):
                assert strings[t[6]] == rt["observation"] and t[8] == rt["completion_tokens"]
                assert strings[t[2]] == (rt["action"] or "")
    assert all(g["won"] for g in data["runs"][0]["games"])  # the expert plans win

    proc = alfrl_here(capfd, "report", str(out / "expert.jsonl"), str(out / "tiny.jsonl"), "--out", str(out / "three"),
                      "--html", "--html-games", "3")  # the page of before/after: the same 3 games in each run
    assert proc.returncode == 0, proc.stderr
    shown = [[g["id"] for g in r["games"]] for r in _data((out / "three" / "report.html").read_text())["runs"]]
    assert len(shown[0]) == 3 and shown[0] == shown[1] and set(shown[0]) <= {g.id for g in games}


def test_rollouts_show_group_rewards_and_advantages(evals, tiny_model_dir, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from alfrl.datamodule import rollout_records
    from alfrl.engines import HFEngine

    _, games = evals
    fmt = chat_format(tiny_tokenizer, "tool_call")
    cfg = RolloutConfig(max_episode_steps=4, max_trajectory_tokens=6000, max_assistant_tokens=32)
    with EnvPool(num_workers=2) as pool:  # a real training rollout of the tiny model: 2 games x 3
        engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer.pad_token_id)
        groups = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run(games[:2], 3, seed=5)
    dump = tmp_path / "step-000001-rank0.jsonl"  # what data.save_rollouts writes
    dump.write_text("".join(json.dumps(r) + "\n" for r in rollout_records(groups)))
    data = _data(build_page([], "", [], [("step 0", dump)]))
    (run,) = data["runs"]
    assert run["training"] and len(run["games"]) == 6
    for g, t in zip(run["games"], [t for group in groups for t in group.trajectories]):
        rewards = [x.reward for x in groups[t.group_id].trajectories]
        assert g["group_rewards"] == pytest.approx(rewards) and g["advantage"] == pytest.approx(t.reward - sum(rewards) / 3)
    # in a browser: each trajectory labelled in the list, and a link (the address bar's too) opens one trajectory
    from urllib.parse import urlencode

    page = tmp_path / "page.html"
    page.write_text(build_page([], "", [], [("step 1", dump)]), encoding="utf-8")
    g = run["games"][4]
    fragment = "#" + urlencode({"run": 0, "game": g["id"], "group": g["group"], "index": g["index"]})
    dom = _chromium(page, fragment)
    assert [f"group {x['group']}, trajectory {x['index'] + 1} of 3, reward" in dom for x in run["games"]] == [True] * 6
    assert f"<h3 class=\"{'won' if g['won'] else 'lost'}\">" in dom and f"group 1, trajectory {g['index'] + 1} of 3: reward" in dom
    assert f'<a href="{fragment.replace("&", "&amp;")}">link to this trajectory</a>' in dom


def test_reasoning_and_action_are_shown_apart():
    assert split_completion("<think>the lamp</think><action>use desklamp 1</action>") == ("the lamp", "<action>use desklamp 1</action>")
    assert split_completion('I look first.\n<tool_call>{"a": 1}</tool_call>') == ("I look first.", '<tool_call>{"a": 1}</tool_call>')
    assert split_completion("just text") == ("", "just text")


def test_every_text_is_stored_once(evals):
    out, _ = evals
    recs = [json.loads(line) for line in (out / "tiny.jsonl").read_text().splitlines() if '"type": "game"' in line]
    data = _data(build_page([("a", recs), ("b", recs)], "", []))
    assert len(data["strings"]) == len(set(data["strings"]))
    single = len(json.dumps(_data(build_page([("a", recs)], "", []))))
    assert len(json.dumps(data)) < 1.7 * single  # the second run's texts are references, not copies


HOSTILE = ['<img src=x onerror="window.ran=1;document.title=1">', "</script><script>window.ran=2;document.title=2</script>", "<!-- ",
           "<SCRIPT>window.ran=3;document.title=3</SCRIPT>", "\u2028\u2029", "%DATA%", "' onmouseover='window.ran=4", "&lt;b&gt;"]

PAGE_SCRIPT_HARNESS = r"""
const fs = require('fs');
const page = fs.readFileSync(process.argv[2], 'utf8');
const blocks = [...page.matchAll(/<script([^>]*)>([\s\S]*?)<\/script>/gi)];
const data = blocks.find(b => b[1].includes('id="data"'))[2];
const code = blocks.find(b => !b[1].includes('id="data"'))[2];
const els = {}, html = [];
function el(id) {
  if (!els[id]) els[id] = {id, value: '', textContent: '', dataset: {}, options: [], appendChild(c) { this.options.push(c); },
    set innerHTML(v) { html.push(v); this._h = v; }, get innerHTML() { return this._h || ''; }};
  return els[id];
}
global.document = {getElementById: id => id === 'data' ? {textContent: data} : el(id), createElement: () => ({}),
                   querySelectorAll: () => []};
global.location = {hash: ''};
eval(code);
const runs = JSON.parse(data).runs;
runs.forEach((r, ri) => { els.run.value = String(ri); els.other.value = ''; list();
  for (const g of r.games) { show(key(g)); els.other.value = String((ri + 1) % runs.length); show(key(g)); els.other.value = ''; } });
console.log(JSON.stringify({html, names: els.run.options.map(o => o.textContent), ran: global.ran || null}));
"""


def _hostile_page(tmp_path) -> str:
    """A page whose every field of every record, every run name and a rollout file hold HOSTILE values, and a 3 MB completion."""

    def record(k, text):
        turn = {"completion_text": text, "action": text, "valid_format": True, "admissible": True, "format_error": text,
                "observation": text, "observation_before": text, "prompt_tokens": text, "completion_tokens": text,
                "finish_reason": text, "status": text}
        return {"type": "game", "game_id": f"valid_seen:{text}{k}", "split": text, "task_type": text, "task": text, "won": False,
                "steps": 1, "invalid_actions": text, "stop_reason": text, "reward": text, "turns": [turn]}

    runs = [(name, [record(k, text) for k, text in enumerate(HOSTILE)]) for name in (HOSTILE[0], "%DATA%")]
    rollout = tmp_path / "step-000001-rank0.jsonl"
    rollout.write_text("".join(json.dumps({**record(k, t), "type": "trajectory", "group": t, "index": t, "reward": 0.5}) + "\n"
                               for k, t in enumerate(HOSTILE)))
    big = record(0, "ok")
    big["turns"][0]["completion_text"] = "<think>" + "x" * 3_000_000  # a completion of 3 MB
    return build_page(runs + [("big", [big])], "| run |\n|---|\n| %DATA% |\n", [], [(HOSTILE[1], rollout)])


def _chromium(page, fragment: str = "") -> str:
    """The page's DOM after its script ran in headless Chromium (the distribution's package), opened at ``#fragment``."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium here (apt-get install chromium; .ci/run installs it)")
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", "--dump-dom",
                          f"{page.as_uri()}{fragment}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    return out.stdout


def _listed(dom: str) -> list[str]:
    """The data-k of every game in the page's list, as the browser drew it."""
    import html

    drawn = dom.split('<script id="data"')[0]  # not the page's own script text
    return [html.unescape(k) for k in re.findall(r'<div class="game" data-k="([^"]*)"', drawn)]


def test_in_chromium_every_hostile_game_is_listed_as_text_and_no_script_from_the_data_runs(tmp_path):
    """Issue "Nothing lost, nothing injected": the page opened in a real browser for each run, and one game side by side:
    every game listed, the hostile values shown as text, the title untouched (each payload would change it)."""
    page = tmp_path / "page.html"
    page.write_text(_hostile_page(tmp_path), encoding="utf-8")
    runs = _data(page.read_text(encoding="utf-8"))["runs"]
    for i, run in enumerate(runs):
        dom = _chromium(page, f"#run={i}")
        assert "<title>alfrl report</title>" in dom and "data-ran" not in dom, f"a script from the data ran (run {i})"
        assert f"{len(run['games'])} of {len(run['games'])} games" in dom
        keys = [g["id"] + (f"#{g['group']}.{g['index']}" if "group" in g else "") for g in run["games"]]
        assert _listed(dom) == keys
    game = runs[0]["games"][0]["id"]
    from urllib.parse import urlencode

    dom = _chromium(page, "#" + urlencode({"run": 0, "other": 1, "game": game}))
    assert "<title>alfrl report</title>" in dom and dom.count('class="col"') >= 2  # both runs' turns drawn
    assert "&lt;img src=x onerror=" in dom and "<img src=x" not in dom


def test_hostile_values_in_every_field_reach_the_page_as_text(tmp_path):
    """Model output and files on disk are untrusted: every field of an evaluation or rollout record, and every run name,
    is shown as text. The data block survives </script, <!--, <script and U+2028/9 (JSON.parse gives the values back),
    a run named %DATA% pastes nothing, and the page's own script (run in node with a stand-in DOM for every game, alone
    and side by side) writes no markup from them."""
    import shutil
    import subprocess

    page = _hostile_page(tmp_path)
    assert len(page) < 3_000_000 + 200_000  # the run named %DATA% and the 3 MB completion: stored once, pasted nowhere else
    assert page.count("<script") == 2 and page.count("</script") == 2  # the page's own two blocks, nothing from the data
    for text in HOSTILE[:5]:
        assert text not in page.replace("%DATA%", "")
    data = _data(page)
    assert data["runs"][0]["name"] == HOSTILE[0] and data["runs"][1]["name"] == "%DATA%" and data["runs"][3]["name"] == HOSTILE[1]
    assert set(HOSTILE) <= set(data["strings"])  # every value comes back exactly
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node here to run the page's script")
    (tmp_path / "page.html").write_text(page)
    (tmp_path / "harness.js").write_text(PAGE_SCRIPT_HARNESS)
    out = subprocess.run([node, str(tmp_path / "harness.js"), str(tmp_path / "page.html")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["ran"] is None and result["names"][:2] == [HOSTILE[0], "%DATA%"]
    written = "".join(result["html"])
    listed = sum(h.count('class="game"') for h in result["html"])
    assert listed >= len(HOSTILE) * 3  # every game of the three runs listed
    for fragment in result["html"]:  # only the page's own tags: each hostile text arrives escaped
        tags = set(re.findall(r"<\s*([a-zA-Z!/][a-zA-Z0-9]*)", fragment))
        assert tags <= {"div", "/div", "span", "/span", "h3", "/h3", "h4", "/h4", "p", "/p", "a", "/a"}, tags
        text = re.sub(r' href="#[^"<>]*"', "", fragment)  # a link: the values percent-encoded inside its quotes
        assert "onerror" not in text.replace("onerror=&quot;", "") and "onmouseover='" not in text
    assert "&lt;img src=x onerror=&quot;window.ran=1;document.title=1&quot;&gt;" in written and "&amp;lt;b&amp;gt;" in written
