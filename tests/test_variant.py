"""benches/variant.py: the one constant named is edited, and nothing else is."""

from __future__ import annotations

import bench_scripts
import pytest

variant = bench_scripts.load("variant")


def tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / "rust" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_named_constant_gets_the_value_and_its_neighbours_keep_theirs(tmp_path):
    root = tree(
        tmp_path,
        {
            "pool/a.rs": "const ROOMY_SHARE: f64 = 0.9;\nconst ROOMY_SHARE_2: f64 = 0.9;\n",
            "pool/b.rs": "/// x\npub const KEEP_PAGES: u64 = 8;\n    pub(super) const MIN_SEEN: u32 = 2;\n",
        },
    )
    variant.edit(root, "ROOMY_SHARE", "0.75")
    variant.edit(root, "KEEP_PAGES", "4")
    variant.edit(root, "MIN_SEEN", "1")
    assert (root / "rust/pool/a.rs").read_text() == "const ROOMY_SHARE: f64 = 0.75;\nconst ROOMY_SHARE_2: f64 = 0.9;\n"
    expected = "/// x\npub const KEEP_PAGES: u64 = 4;\n    pub(super) const MIN_SEEN: u32 = 1;\n"
    assert (root / "rust/pool/b.rs").read_text() == expected


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("MISSING", "const MISSING is declared 0 times"),
        ("TWICE", "const TWICE is declared 2 times"),
        ("lower", "'lower' is not a constant's name"),
        ("A.*", "'A.*' is not a constant's name"),
    ],
)
def test_a_constant_declared_other_than_once_is_refused(tmp_path, name, message):
    root = tree(tmp_path, {"a.rs": "const TWICE: u64 = 1;\n", "b/c.rs": "const TWICE: u64 = 2;\n"})
    with pytest.raises(SystemExit, match=message.replace(".", r"\.").replace("*", r"\*")):
        variant.edit(root, name, "3")
    assert (root / "rust/a.rs").read_text() == "const TWICE: u64 = 1;\n"


def test_help_prints_the_usage_and_succeeds(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["variant.py", "--help"])
    with pytest.raises(SystemExit) as exit:
        variant.main()
    assert exit.value.code == 0
    assert "NAME=VALUE [NAME=VALUE ...] -- COMMAND" in capsys.readouterr().out
