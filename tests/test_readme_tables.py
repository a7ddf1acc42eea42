"""The README's results tables are the ones benchmarks/readme_tables.py builds from the committed
results files, and its --check catches a single altered figure, naming the table."""

import subprocess
import sys
from pathlib import Path

import pytest

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


# --- inline figures in the prose --------------------------------------------------------------

EAGER_S = "<!-- fig:compile_speed_s:row=mesa int8:step_ratio:x -->1.47x<!-- /fig -->"


def test_the_readme_has_inline_figures_and_they_match():
    assert README.count("<!-- fig:") >= 25
    assert README.count("<!-- fig:") == README.count("<!-- /fig -->")
    assert EAGER_S in README  # DeiT-S eager step ratio in Limits, compile_speed_s.jsonl
    assert readme_tables._check_figures(README, ROOT) == []


def test_an_altered_inline_figure_fails_naming_it_and_its_line():
    line = README[: README.index(EAGER_S)].count("\n") + 1
    altered = README.replace(EAGER_S, EAGER_S.replace("1.47x", "1.48x"))
    problems = readme_tables.check(altered)
    assert len(problems) == 1, problems
    msg = problems[0]
    assert msg.startswith(f"figure differs from the results files at README.md line {line}:"), msg
    assert "<!-- fig:compile_speed_s:row=mesa int8:step_ratio:x -->" in msg
    assert "'1.48x'" in msg and "'1.47x'" in msg
    assert readme_tables.update(altered) == README


def test_a_summary_figure_is_checked_too():
    # the paired accuracy difference: mean over 20 seeds of (int8 - plain), accuracy_digits_gpu
    marker = "diff_mean(test_acc, config=plain, seed):+.2f -->-0.33<!-- /fig -->"
    assert marker in README
    problems = readme_tables.check(README.replace(marker, marker.replace("-0.33", "-0.34")))
    assert len(problems) == 1 and "'-0.34'" in problems[0] and "'-0.33'" in problems[0]


def test_a_selection_matching_no_row_fails_naming_the_marker():
    bad = EAGER_S.replace("row=mesa int8", "row=mesa int9")
    problems = readme_tables.check(README.replace(EAGER_S, bad))
    assert len(problems) == 1, problems
    assert "<!-- fig:compile_speed_s:row=mesa int9:step_ratio:x -->" in problems[0]
    assert "0 rows of compile_speed_s.jsonl match {'row': 'mesa int9'}, expected 1" in problems[0]


def test_a_selection_matching_several_rows_or_a_missing_close_fails():
    several = EAGER_S.replace("row=mesa int8", "row=mesa int8|plain")
    problems = readme_tables.check(README.replace(EAGER_S, several))
    assert "2 rows of compile_speed_s.jsonl match" in problems[0], problems
    unclosed = README.replace(EAGER_S, EAGER_S.replace("<!-- /fig -->", ""))
    assert "no <!-- /fig -->" in readme_tables.check(unclosed)[0]


def test_figure_formats_and_summaries():
    src = readme_tables._Sources(ROOT)
    fig = readme_tables.figure
    assert fig("compile_speed_s_before_fix:row=mesa int8:activation_mib:mib", src) == "1,501"
    assert fig("compile_speed_s_before_fix:row=mesa int8:step_ms:ms", src) == "53.9"
    assert fig("compile_speed_s_before_fix:row=mesa int8:step_ms:.0f", src) == "54"
    assert fig("deit_speed_gpu::each(torch):s", src) == "2.11.0+cu130"
    assert fig("grad_fidelity_gpu:bits=8&rounding=nearest:median(sqnr_db):.1f", src) == "45.7"
    lo = "accuracy_digits_gpu:config=mesa int8:diff_lo95(test_acc, config=plain, seed):+.2f"
    assert fig(lo, src) == "-1.16"  # -0.33 - 1.96 s.e., as accuracy_digits_gpu.md
    with pytest.raises(ValueError, match=r"each\(reduction\) differs across the 2 rows"):
        fig("coverage_gpu:model=resnet50|convnext_tiny:each(reduction):x", src)


def test_a_marker_that_begins_a_line_is_refused():
    # Markdown would read such a line as a raw HTML block and break the paragraph
    text = f"Speed:\n{EAGER_S} slower.\n"
    problems = readme_tables._check_figures(text, ROOT)
    assert len(problems) == 1 and "begins its line" in problems[0], problems
    assert readme_tables._check_figures(f"Speed: {EAGER_S} slower.\n", ROOT) == []
