"""The README's results tables are the ones benchmarks/readme_tables.py builds from the committed
results files, and its --check catches a single altered figure, naming the table."""

import subprocess
import sys
from pathlib import Path

from benchmarks import readme_tables

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_tables_match_the_results_files():
    assert readme_tables.check(README) == []


def test_every_table_has_its_markers_and_rows():
    for name in readme_tables.TABLES:
        a, b = readme_tables._span(README, name)
        lines = README[a:b].splitlines()
        assert lines[0].startswith("| model |"), (name, lines[0])
        assert sum(line.startswith("| ") for line in lines) >= 3, name  # header and 2+ rows


def test_an_altered_figure_fails_naming_the_table():
    # DeiT-S's step ratio in the deit table, from compile_speed_s.jsonl (35.7 / 52.4 ms)
    row = next(line for line in README.splitlines() if line.startswith("| DeiT-S | 4,699 |"))
    assert "| 1.47x |" in row
    altered = README.replace(row, row.replace("| 1.47x |", "| 1.46x |"))
    problems = readme_tables.check(altered)
    assert len(problems) == 1
    assert problems[0].startswith("table 'deit' differs"), problems[0]
    assert "1.46x" in problems[0] and "1.47x" in problems[0]


def test_a_missing_marker_is_reported():
    problems = readme_tables.check(README.replace("<!-- /table:llm -->", ""))
    assert any("table:llm" in p for p in problems), problems


def test_update_restores_an_altered_readme():
    row = next(line for line in README.splitlines() if line.startswith("| ConvNeXt-T |"))
    altered = README.replace(row, row.replace("2.19x", "9.99x"))
    assert readme_tables.update(altered) == README


def test_check_command_exits_nonzero_on_a_stale_readme_without_importing_torch(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(README.replace("| 4,699 | 1,980 |", "| 4,699 | 1,981 |"))
    probe = (
        "import runpy, sys\n"
        "sys.argv = [sys.argv[1], '--check', '--readme', sys.argv[2]]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'TORCH', 'torch' in sys.modules)\n"
    )
    script = str(ROOT / "benchmarks" / "readme_tables.py")
    proc = subprocess.run([sys.executable, "-c", probe, script, str(stale)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.stdout.strip() == "EXIT 1 TORCH False", (proc.stdout, proc.stderr)
    assert "table 'deit' differs" in proc.stderr and "1,981" in proc.stderr
