"""The benchmark runner (`icml26 bench`) and the shared benchmark metadata, on tiny fake benchmark scripts."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from icml26.harness import bench

FAKE = '''
"""A fake benchmark: writes a JSON with ratios that depend on the thread count it was given."""
import argparse, json, os

BENCH = {"room": "fakeroom", "args": ["--scale", "2"],
         "ratios": {"method / base": "rows[arm=method].ratio", "second": "extra.values[1]"},
         "threads_arg": "--threads"}

parser = argparse.ArgumentParser()
parser.add_argument("--scale", type=float)
parser.add_argument("--threads", type=int)
parser.add_argument("--out")
args = parser.parse_args()
with open(args.out, "w") as f:
    json.dump({"rows": [{"arm": "base", "ratio": 1.0}, {"arm": "method", "ratio": args.scale * args.threads}],
               "extra": {"values": [0, 0.5]}, "env_threads": os.environ["OMP_NUM_THREADS"]}, f)
'''


def _write(directory, name, text):
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def test_machine_info_names_cpu_threads_blas_commit_and_load():
    info = bench.machine_info(3)
    assert info["torch_threads"] == 3
    assert info["cpu_model"] and info["cpu_model"] != "x86_64" or not os.path.exists("/proc/cpuinfo")
    for key in ("cpu_count", "torch", "blas", "cpu_capability", "git_sha", "git_dirty", "loadavg_start"):
        assert key in info
    assert "loadavg_end" not in info and "loadavg_end" in bench.finish_machine_info(info)


def test_write_bench_json_keeps_fields_and_adds_machine(tmp_path):
    machine = bench.machine_info(1)
    path = bench.write_bench_json(tmp_path / "r.json", {"benchmark": "x", "rows": [1, 2]}, machine)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "x" and data["rows"] == [1, 2]
    assert data["machine"]["torch_threads"] == 1 and "loadavg_end" in data["machine"]
    with pytest.raises(TypeError, match="result must be a dict"):
        bench.write_bench_json(tmp_path / "bad.json", [1, 2])
    assert not (tmp_path / "bad.json").exists()


def test_json_path_keys_indices_and_selectors():
    data = {"sizes": [{"size": "quick", "rows": [{"arm": "a", "r": 1.5}]},
                      {"size": "full", "rows": [{"arm": "a", "r": 2}]}]}
    assert bench.json_path(data, "sizes[size=full].rows[arm=a].r") == 2
    assert bench.json_path(data, "sizes[0].rows[-1].r") == 1.5
    rows = {"rows": [{"part": "memory", "T": 8, "r": 0}, {"part": "timing", "T": 8, "r": 3}]}
    assert bench.json_path(rows, "rows[part=timing,T=8].r") == 3 and bench.json_path(rows, "rows[T=8].r") == 0
    with pytest.raises(KeyError, match="no element with size = wide"):
        bench.json_path(data, "sizes[size=wide].rows")
    with pytest.raises(KeyError, match="no key 'nope'"):
        bench.json_path(data, "nope")
    with pytest.raises(KeyError, match="out of range"):
        bench.json_path(data, "sizes[5]")


def test_read_entry_checks_the_literal(tmp_path):
    script = _write(tmp_path, "fake_step.py", FAKE)
    entry = bench.read_entry(script)
    assert entry["room"] == "fakeroom" and entry["out_arg"] == "--out"
    assert bench.read_entry(_write(tmp_path, "none.py", "x = 1\n")) is None
    with pytest.raises(ValueError, match="needs 'ratios'"):
        bench.read_entry(_write(tmp_path, "bad1.py", "BENCH = {'room': 'r', 'args': []}\n"))
    with pytest.raises(ValueError, match="unknown keys"):
        bench.read_entry(_write(tmp_path, "bad2.py", "BENCH = {'room': 'r', 'args': [], 'ratios': {'a': 'b'}, "
                                                     "'x': 1}\n"))
    with pytest.raises(ValueError, match="'seconds'\\] must be positive"):
        bench.read_entry(_write(tmp_path, "bad4.py", "BENCH = {'room': 'r', 'args': [], 'ratios': {'a': 'b'}, "
                                                     "'seconds': 0}\n"))
    with pytest.raises(ValueError, match="literal"):
        bench.read_entry(_write(tmp_path, "bad3.py", "BENCH = dict(room='r')\n"))


def test_runner_runs_each_script_at_each_thread_count_and_writes_the_table(tmp_path):
    scripts = tmp_path / "benchmarks"
    _write(scripts, "fake_step.py", FAKE)
    _write(scripts, "other_step.py", FAKE.replace("fakeroom", "otherroom"))
    _write(scripts, "helper.py", "raise SystemExit('not a benchmark: never run')\n")
    out = tmp_path / "out"
    page, records = bench.run_benchmarks(["fakeroom"], [1, 2], out, bench_dir=scripts, budget_s=120, echo=False)
    assert [(r["script"], r["threads"], r["status"]) for r in records] == [("fake_step.py", 1, "ok"),
                                                                          ("fake_step.py", 2, "ok")]
    assert [r["ratios"]["method / base"] for r in records] == [2.0, 4.0]
    assert records[0]["ratios"]["second"] == 0.5
    assert json.loads((out / "fake_step_t2.json").read_text())["env_threads"] == "2"
    text = page.read_text()
    assert "| fakeroom | `fake_step.py` | method / base | 2.00× | 4.00× |" in text
    assert records[0]["machine"]["cpu_model"] in text
    summary = json.loads((out / "bench.json").read_text())
    assert summary["threads"] == [1, 2] and len(summary["runs"]) == 2


def test_runner_reports_failures_and_rejects_bad_requests(tmp_path):
    scripts = tmp_path / "benchmarks"
    _write(scripts, "broken_step.py", "BENCH = {'room': 'broken', 'args': [], 'ratios': {'r': 'x'}}\n"
                                      "raise SystemExit(3)\n")
    _, records = bench.run_benchmarks(None, [1], tmp_path / "out", bench_dir=scripts, budget_s=60, echo=False)
    assert records[0]["status"] == "exit 3" and records[0]["ratios"] == {}
    with pytest.raises(ValueError, match="no benchmark script declares a BENCH entry for room"):
        bench.run_benchmarks(["nosuchroom"], [1], tmp_path / "o2", bench_dir=scripts, echo=False)
    with pytest.raises(ValueError, match="threads must be positive"):
        bench.run_benchmarks(None, [0], tmp_path / "o3", bench_dir=scripts, echo=False)
    assert not (tmp_path / "o3").exists()


def test_budget_is_shared_in_proportion_to_declared_seconds(tmp_path, monkeypatch):
    scripts = tmp_path / "benchmarks"
    for name, seconds in (("a_step.py", 30), ("b_step.py", 90)):
        _write(scripts, name, f"BENCH = {{'room': '{name[0]}', 'args': [], 'ratios': {{'r': 'x'}}, "
                              f"'seconds': {seconds}}}\n")
    timeouts = []
    # Read once here: its first call imports torch (seconds on a loaded machine), which the budget would count
    # as the first script's time.
    machine = bench.machine_info(1)

    def fake_run(script, entry, threads, out_dir, timeout_s, python):
        timeouts.append(timeout_s)
        return {"script": script.name, "room": entry["room"], "threads": threads, "status": "ok", "ratios": {},
                "wall_s": 0.0, "machine": machine}

    monkeypatch.setattr(bench, "run_script", fake_run)
    bench.run_benchmarks(None, [1], tmp_path / "out", bench_dir=scripts, budget_s=400, echo=False)
    assert timeouts[0] == pytest.approx(100, abs=1) and timeouts[1] == pytest.approx(400, abs=1)


def test_repository_bench_entries_parse():
    entries = bench.discover()
    rooms = {entry["room"] for _, entry in entries}
    assert {"kromhc", "adamezo"} <= rooms


def test_cli_bench_refuses_a_room_without_a_bench_entry(capsys):
    from icml26.cli import main

    assert main(["bench", "sherpa", "--threads", "1", "--out", "/nonexistent-never-created"]) == 2
    assert "no benchmark script declares a BENCH entry for room(s) ['sherpa']" in capsys.readouterr().err
    assert not os.path.exists("/nonexistent-never-created")


def _card(methods, room, body):
    card = methods / room / "README.md"
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(body)
    return card


def test_cards_get_their_rooms_rows_from_a_recorded_run(tmp_path):
    scripts = tmp_path / "benchmarks"
    _write(scripts, "fake_step.py", FAKE)
    _write(scripts, "other_step.py", FAKE.replace("fakeroom", "otherroom"))
    bench.run_benchmarks(None, [1, 2], tmp_path / "out", bench_dir=scripts, budget_s=120, echo=False)
    methods = tmp_path / "methods"
    fake = _card(methods, "fakeroom",
                 f"# fake\n## Speed\nbefore\n{bench.CARD_BEGIN}\nstale row\n{bench.CARD_END}\nafter\n")
    other = _card(methods, "otherroom", f"{bench.CARD_BEGIN}\n{bench.CARD_END}\n")
    written = bench.update_cards(tmp_path / "out" / "bench.json", methods)
    assert sorted(written) == sorted([fake, other])
    text = fake.read_text()
    assert text.startswith("# fake\n## Speed\nbefore\n") and text.endswith(f"{bench.CARD_END}\nafter\n")
    assert "stale row" not in text and "otherroom" not in text
    assert "| `fake_step.py` | method / base | 2.00× | 4.00× |" in text
    sha = json.loads((tmp_path / "out" / "bench.json").read_text())["runs"][0]["machine"]["git_sha"]
    assert f"commit `{sha[:12]}`" in text
    # Regenerating from the same JSON changes nothing.
    bench.update_cards(tmp_path / "out" / "bench.json", methods)
    assert fake.read_text() == text


def test_cards_without_markers_are_refused_before_any_is_written(tmp_path):
    scripts = tmp_path / "benchmarks"
    _write(scripts, "fake_step.py", FAKE)
    _write(scripts, "other_step.py", FAKE.replace("fakeroom", "otherroom"))
    bench.run_benchmarks(None, [1], tmp_path / "out", bench_dir=scripts, budget_s=120, echo=False)
    methods = tmp_path / "methods"
    fake = _card(methods, "fakeroom", f"{bench.CARD_BEGIN}\nold\n{bench.CARD_END}\n")
    _card(methods, "otherroom", "# a card without markers\n")
    with pytest.raises(ValueError, match="otherroom/README.md: needs one"):
        bench.update_cards(tmp_path / "out" / "bench.json", methods)
    assert fake.read_text() == f"{bench.CARD_BEGIN}\nold\n{bench.CARD_END}\n"
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a bench.json"):
        bench.update_cards(tmp_path / "bad.json", methods)


def test_repository_cards_carry_the_markers_of_every_benchmarked_room():
    methods = Path(bench.__file__).resolve().parents[1] / "methods"
    for room in {entry["room"] for _, entry in bench.discover()}:
        text = (methods / room / "README.md").read_text()
        assert text.count(bench.CARD_BEGIN) == 1 and text.count(bench.CARD_END) == 1, room


def test_cli_cards_from_names_a_bad_file(tmp_path, capsys):
    from icml26.cli import main

    bad = tmp_path / "bench.json"
    bad.write_text('{"runs": []}')
    assert main(["bench", "--cards-from", str(bad)]) == 2
    assert "not a bench.json with runs" in capsys.readouterr().err
