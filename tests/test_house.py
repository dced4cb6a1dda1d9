"""The house limits hold (``scripts/house.py``): classes of at most 25 methods, functions of at most
80 lines, modules of at most 800 (recovery's 450), folders of at most 15 modules, constructors of at
most 8 parameters, no import circle. Read from the source; nothing is imported."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _house():
    spec = importlib.util.spec_from_file_location("house", ROOT / "scripts" / "house.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_code_is_within_the_house_limits():
    assert _house().breaches() == []


def test_the_check_names_what_breaks_a_limit(tmp_path):
    house = _house()
    pkg = tmp_path / "recovery"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "big.py").write_text("x = 1\n" * 451)
    (pkg / "wide.py").write_text(
        "class Wide:\n"
        + "".join(f"    def m{i}(self):\n        pass\n" for i in range(26))
        + "    def __init__(self, a, b, c, d, e, f, g, h, i):\n        pass\n"
        + "def long():\n"
        + "    x = 1\n" * 80
    )
    (pkg / "a.py").write_text("from recovery import b\n")
    (pkg / "b.py").write_text("def f():\n    from recovery.a import x\n")
    for name in ("recsys", "embeddings", "data"):
        (tmp_path / name).mkdir()
    (tmp_path / "scripts").mkdir()
    got = "\n".join(house.breaches(tmp_path))
    assert "recovery/big.py: 451 lines (limit 450)" in got
    assert "recovery/wide.py:Wide: 27 methods (limit 25)" in got
    assert "recovery/wide.py:Wide.__init__: 9 parameters (limit 8)" in got
    assert "recovery/wide.py:56:long: 81 lines (limit 80)" in got
    assert "import circle: recovery.a -> recovery.b -> recovery.a" in got
