"""The static registry agrees with the rooms on disk, and listing imports no room."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from icml26.core.registry import ROOMS, RoomEntry, _check, get_room, import_room, room_card

METHODS = Path(__file__).resolve().parents[2] / "src" / "icml26" / "methods"
EXPECTED = {"adamezo", "janus_lora", "annotation_anchoring", "fix_attention", "csplora", "dare", "feddtl",
            "starembed", "lokra", "lockin", "pgt", "salaad", "kromhc", "tabicl2", "scalora", "entropy_rft",
            "calm", "sherpa", "omni_fmri"}


def test_all_19_rooms_registered():
    assert {r.name for r in ROOMS} == EXPECTED


def test_registry_and_room_folders_agree_both_ways():
    folders = {p.name for p in METHODS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    implemented = {r.name for r in ROOMS if r.status != "planned"}
    assert folders <= EXPECTED, f"room folders not in the registry: {folders - EXPECTED}"
    assert implemented <= folders, f"implemented rooms without a folder: {implemented - folders}"
    for name in implemented:
        room = get_room(name)
        for required in ("README.md", "config.py", "reference.py", "experiments.py", "__init__.py"):
            assert (room.folder / required).exists(), f"{name} lacks {required}"
        assert import_room(name).__name__ == room.import_path


def test_bad_entries_are_rejected():
    with pytest.raises(ValueError, match="snake_case"):
        _check((RoomEntry("Bad-Name", "optimizer", "t", "", "c"),))
    with pytest.raises(ValueError, match="twice"):
        _check((RoomEntry("a_b", "optimizer", "t", "", "c"),) * 2)
    with pytest.raises(ValueError, match="family"):
        _check((RoomEntry("a_b", "gadget", "t", "", "c"),))
    with pytest.raises(KeyError, match="known rooms"):
        get_room("nope")


PLANNED = RoomEntry("future_room", "layer", "A paper not built yet", "", "a layer")


@pytest.fixture
def with_planned_room(monkeypatch):
    """Every paper now has a room, so the planned-room paths are checked on a registered placeholder."""
    import icml26.cli
    import icml26.core.registry as registry

    monkeypatch.setattr(registry, "ROOMS", registry.ROOMS + (PLANNED,))
    monkeypatch.setattr(icml26.cli, "ROOMS", registry.ROOMS)


def test_planned_room_cannot_be_imported_or_reproduced(with_planned_room, capsys):
    from icml26.cli import main

    with pytest.raises(LookupError, match="planned"):
        import_room("future_room")
    assert main(["reproduce", "future_room", "--tier", "smoke"]) == 2
    assert "planned" in capsys.readouterr().err


def test_room_card_is_the_readme_or_a_stub(with_planned_room):
    assert "AdaMeZO" in room_card("adamezo")
    assert "Not implemented yet" in room_card("future_room")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icml26.cli", *args], capture_output=True, text=True, timeout=120)


def test_list_json_lists_19_rooms_without_importing_rooms_or_heavy_deps():
    out = _cli("list", "--json")
    assert out.returncode == 0, out.stderr
    rooms = json.loads(out.stdout)
    assert len(rooms) == 19 and all({"name", "status"} <= set(r) for r in rooms)
    probe = ("import sys, io, contextlib; from icml26.cli import main; buf = io.StringIO();\n"
             "with contextlib.redirect_stdout(buf): main(['list'])\n"
             "bad = [m for m in sys.modules if m.startswith(('icml26.methods.', 'torch', 'transformers', 'sklearn'))]\n"
             "print(bad)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


def test_show_and_errors():
    out = _cli("show", "adamezo")
    assert out.returncode == 0 and "Fidelity" in out.stdout
    out = _cli("reproduce", "nope")
    assert out.returncode == 2 and "unknown room" in out.stderr
