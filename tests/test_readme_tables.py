"""The results tables of README.md and docs/RESULTS.md are the ones benchmarks/readme_tables.py
builds from the committed results files, each table in exactly one of the two, and its --check
catches a single altered figure in either, naming the table; the README stays short."""

import posixpath
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mesa_lite.benchmarks import readme_tables

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOC = readme_tables.DOC  # docs/RESULTS.md
RESULTS_DOC = (ROOT / DOC).read_text()
GUIDE = (ROOT / readme_tables.GUIDE).read_text()
TEXTS = {readme_tables.README: README, DOC: RESULTS_DOC, readme_tables.GUIDE: GUIDE}


def test_readme_tables_match_the_results_files():
    assert readme_tables.check(README) == []


def test_results_doc_tables_match_the_results_files():
    assert readme_tables.check(RESULTS_DOC, doc=DOC) == []
    assert readme_tables.check_documents(TEXTS) == []


def test_the_guides_figures_match_the_results_files():
    """The GUIDE's "Which option when" table quotes the results files through figures."""
    assert readme_tables.check(GUIDE, doc=readme_tables.GUIDE) == []
    section = GUIDE[GUIDE.index("## Which option when") : GUIDE.index("## The API in full")]
    assert section.count("<!-- fig:") >= 30, section


def test_every_table_is_in_exactly_one_document():
    held = {doc: readme_tables.tables_in(text) for doc, text in TEXTS.items()}
    for name in readme_tables.TABLES:
        assert sum(name in names for names in held.values()) == 1, (name, held)
    # the long ones live in docs/RESULTS.md, the short ones in the README
    assert {"budget", "compiled"} <= set(held[DOC]), held
    assert {"deit", "cnn", "llm", "ckpt"} <= set(held["README.md"]), held


def test_every_table_has_its_markers_and_rows():
    for doc, text in TEXTS.items():
        for name in readme_tables.tables_in(text):
            a, b = readme_tables._span(text, name, doc)
            lines = text[a:b].splitlines()
            first = "| " if name.startswith("rows;") else "| model |"
            assert lines[0].startswith(first), (doc, name, lines[0])
            assert sum(line.startswith("| ") for line in lines) >= 3, name  # header and 2+ rows


def test_the_links_in_each_table_reach_the_results_files_from_its_document():
    for doc, text in TEXTS.items():
        for name in readme_tables.tables_in(text):
            a, b = readme_tables._span(text, name, doc)
            links = re.findall(r"\]\(([^)]+)\)", text[a:b])
            assert links, (doc, name)
            for link in links:
                path = posixpath.normpath(posixpath.join(posixpath.dirname(doc), link))
                assert (ROOT / path).is_file(), (doc, name, link)
    assert "](../benchmarks/results/budget_gpu_llama.md)" in RESULTS_DOC


def test_the_readme_is_at_most_250_lines():
    # issues 39 and 53: the long tables and the details live in docs/; the README keeps a
    # summary of each
    assert len(README.splitlines()) <= 250, len(README.splitlines())


def test_an_altered_figure_fails_naming_the_table():
    # DeiT-S's step ratio in the deit table, from speed_vit_h100_1206.jsonl (29.6 / 36.0 ms)
    row = next(line for line in README.splitlines() if line.startswith("| DeiT-S | 4,702 |"))
    assert "| 1.22x |" in row
    altered = README.replace(row, row.replace("| 1.22x |", "| 1.21x |"))
    problems = readme_tables.check(altered)
    assert len(problems) == 1
    assert problems[0].startswith("table 'deit' differs"), problems[0]
    assert "1.21x" in problems[0] and "1.22x" in problems[0]


def test_an_altered_figure_in_the_results_doc_fails_naming_the_table():
    # the Llama-shaped 1B's plan at half the plain peak in the budget table, budget_gpu_llama
    row = next(
        line
        for line in RESULTS_DOC.splitlines()
        if line.startswith("| Llama-shaped 1B | plan 0.5 |")
    )
    assert "| 12,022 |" in row
    altered = RESULTS_DOC.replace(row, row.replace("| 12,022 |", "| 12,023 |"))
    line = RESULTS_DOC[: RESULTS_DOC.index(row)].count("\n") + 1
    problems = readme_tables.check(altered, doc=DOC)
    assert len(problems) == 1, problems
    msg = problems[0]
    assert msg.startswith(f"table 'budget' differs from the results files at {DOC} line {line}:"), (
        msg
    )
    assert "12,023" in msg and "12,022" in msg
    assert readme_tables.check_documents({**TEXTS, DOC: altered}) == problems
    assert readme_tables.update(altered, doc=DOC) == RESULTS_DOC


def test_an_altered_inline_figure_in_the_results_doc_fails_naming_it_and_its_line():
    marker = (
        "<!-- fig:compile_speed_s:row=plain compiled, activation_memory_budget 0.5:"
        "activation_reduction:x -->1.54x<!-- /fig -->"
    )
    assert RESULTS_DOC.count(marker) == 1
    line = RESULTS_DOC[: RESULTS_DOC.index(marker)].count("\n") + 1
    altered = RESULTS_DOC.replace(marker, marker.replace("1.54x", "1.55x"))
    problems = readme_tables.check(altered, doc=DOC)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"figure differs from the results files at {DOC} line {line}:")
    assert "'1.55x'" in problems[0] and "'1.54x'" in problems[0]
    assert readme_tables.update(altered, doc=DOC) == RESULTS_DOC


def test_a_missing_marker_is_reported():
    problems = readme_tables.check(README.replace("<!-- /table:llm -->", ""))
    assert any("README.md: table 'llm'" in p and "table:llm" in p for p in problems), problems
    problems = readme_tables.check(RESULTS_DOC.replace("<!-- table:budget -->", ""), doc=DOC)
    assert any(p.startswith(f"{DOC}: table 'budget'") for p in problems), problems


def test_a_table_in_neither_document_or_in_both_is_reported():
    block = re.search(
        r"^<!-- table:budget -->\n.*?^<!-- /table:budget -->\n", RESULTS_DOC, re.M | re.S
    )
    gone = {**TEXTS, DOC: RESULTS_DOC.replace(block[0], "")}
    problems = readme_tables.check_documents(gone)
    assert problems == [
        "table 'budget': no <!-- table:budget --> ... <!-- /table:budget --> block "
        f"in README.md or {DOC} or {readme_tables.GUIDE}"
    ]
    with pytest.raises(ValueError, match="table 'budget': no <!-- table:budget -->"):
        readme_tables.update_documents(gone)
    both = {**TEXTS, "README.md": README + "\n" + block[0]}
    problems = readme_tables.check_documents(both)
    # first the placement, then the copy's links, written for docs/, that differ in the README
    assert problems[0] == (
        f"table 'budget': markers in README.md and {DOC}; a table lives in exactly one of them"
    )
    assert problems[1].startswith("table 'budget' differs from the results files at README.md")
    with pytest.raises(ValueError, match="table 'budget': markers in README.md and"):
        readme_tables.update_documents(both)


def test_a_marker_naming_no_table_is_reported():
    text = README + "\n<!-- table:budgets -->\n<!-- /table:budgets -->\n"
    problems = readme_tables.check(text)
    assert len(problems) == 2 and all("names no table" in p for p in problems), problems
    assert "<!-- table:budgets -->" in problems[0]
    with pytest.raises(ValueError, match="names no table"):
        readme_tables.update(text)


def test_update_restores_an_altered_readme():
    row = next(line for line in README.splitlines() if line.startswith("| ConvNeXt-T |"))
    altered = README.replace(row, row.replace("2.19x", "9.99x"))
    assert readme_tables.update(altered) == README


def _run_script(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/readme_tables.py with ``args``; prints its exit code and whether torch loaded."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'TORCH', 'torch' in sys.modules)\n"
    )
    script = str(ROOT / "benchmarks" / "readme_tables.py")
    return subprocess.run([sys.executable, "-c", probe, script, *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_check_command_exits_nonzero_on_a_stale_readme_without_importing_torch(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(README.replace("| 4,702 | 1,981 |", "| 4,702 | 1,982 |"))
    proc = _run_script("--check", "--readme", str(stale))
    assert proc.stdout.strip() == "EXIT 1 TORCH False", (proc.stdout, proc.stderr)
    assert "table 'deit' differs" in proc.stderr and "1,982" in proc.stderr


def test_check_command_exits_nonzero_on_a_stale_results_doc_naming_the_table(tmp_path):
    stale = tmp_path / "RESULTS.md"
    stale.write_text(RESULTS_DOC.replace("| 4,945 | 5,171 / 4,866 |", "| 4,946 | 5,171 / 4,866 |"))
    proc = _run_script("--check", "--results-doc", str(stale))
    assert proc.stdout.strip() == "EXIT 1 TORCH False", (proc.stdout, proc.stderr)
    assert f"table 'budget' differs from the results files at {DOC} line" in proc.stderr
    assert "4,946" in proc.stderr and "README.md" not in proc.stderr


def test_the_command_rewrites_both_documents(tmp_path):
    readme, doc = tmp_path / "README.md", tmp_path / "RESULTS.md"
    readme.write_text(README.replace("| 4,702 | 1,981 |", "| 4,702 | 1,982 |"))
    doc.write_text(RESULTS_DOC.replace("| 4,945 | 5,171 / 4,866 |", "| 4,946 | 5,171 / 4,866 |"))
    proc = _run_script("--readme", str(readme), "--results-doc", str(doc))
    assert proc.stdout.strip().endswith("EXIT 0 TORCH False"), (proc.stdout, proc.stderr)
    assert readme.read_text() == README and doc.read_text() == RESULTS_DOC
    proc = _run_script("--check", "--readme", str(readme), "--results-doc", str(doc))
    assert proc.stdout.strip().endswith("EXIT 0 TORCH False"), (proc.stdout, proc.stderr)


# --- inline figures in the prose --------------------------------------------------------------

EAGER_S = "<!-- fig:llm_memory_gpu_bert:model=bert&mode=int8:step_ratio:x -->1.88x<!-- /fig -->"


def test_the_readme_has_inline_figures_and_they_match():
    assert README.count("<!-- fig:") >= 20
    assert README.count("<!-- fig:") == README.count("<!-- /fig -->")
    assert EAGER_S in README  # BERT's eager step ratio in Limits, llm_memory_gpu_bert.jsonl
    assert readme_tables._check_figures(README, ROOT) == []


def test_the_results_doc_has_inline_figures_and_they_match():
    assert RESULTS_DOC.count("<!-- fig:") >= 20
    assert RESULTS_DOC.count("<!-- fig:") == RESULTS_DOC.count("<!-- /fig -->")
    assert readme_tables._check_figures(RESULTS_DOC, ROOT, DOC) == []


def test_an_altered_inline_figure_fails_naming_it_and_its_line():
    line = README[: README.index(EAGER_S)].count("\n") + 1
    altered = README.replace(EAGER_S, EAGER_S.replace("1.88x", "1.89x"))
    problems = readme_tables.check(altered)
    assert len(problems) == 1, problems
    msg = problems[0]
    assert msg.startswith(f"figure differs from the results files at README.md line {line}:"), msg
    assert EAGER_S.split("-->")[0] + "-->" in msg
    assert "'1.89x'" in msg and "'1.88x'" in msg
    assert readme_tables.update(altered) == README


def test_a_summary_figure_is_checked_too():
    # the paired accuracy difference: mean over 20 seeds of (int8 - plain), accuracy_digits_gpu
    marker = "diff_mean(test_acc, config=plain, seed):+.2f -->-0.33<!-- /fig -->"
    assert marker in README
    problems = readme_tables.check(README.replace(marker, marker.replace("-0.33", "-0.34")))
    assert len(problems) == 1 and "'-0.34'" in problems[0] and "'-0.33'" in problems[0]


def test_a_selection_matching_no_row_fails_naming_the_marker():
    bad = EAGER_S.replace("mode=int8", "mode=int9")
    problems = readme_tables.check(README.replace(EAGER_S, bad))
    assert len(problems) == 1, problems
    assert "mode=int9:step_ratio:x -->" in problems[0]
    assert "0 rows of llm_memory_gpu_bert.jsonl match" in problems[0], problems
    assert "'mode': 'int9'" in problems[0] and "expected 1" in problems[0], problems


def test_a_selection_matching_several_rows_or_a_missing_close_fails():
    several = EAGER_S.replace("mode=int8", "mode=int8|plain")
    problems = readme_tables.check(README.replace(EAGER_S, several))
    assert "2 rows of llm_memory_gpu_bert.jsonl match" in problems[0], problems
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


def test_the_readme_test_line_counts_the_suite_as_it_is():
    """The README's "N passed, M skipped" (the last full run) is within 5% of the tests the
    suite collects now: a stale line (2,426 when the suite had 4,300) fails here. Counted with
    the test extra installed (without it whole files skip at collection)."""
    for extra in ("transformers", "accelerate", "peft"):
        pytest.importorskip(extra)
    m = re.search(r"\(([\d,]+) passed, ([\d,]+) skipped in [\d,]+ s on torch", README)
    assert m, "the README's test line moved or changed form"
    said = sum(int(g.replace(",", "")) for g in m.groups())
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # the default tier: "N/M tests collected (K deselected)" with the exhaustive one left out
    found = re.search(r"^(\d+)(?:/\d+)? tests collected", proc.stdout, re.M)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = int(found[1])
    assert abs(said - collected) <= 0.05 * collected, (said, collected)


ROWS_SPEC = (
    "rows;checkpoint_pareto_gpu_repeats;model=deit_base_patch16_224;label/s,peak_mib/mib,sqnr_db/db"
)


def test_a_rows_table_lists_the_selected_rows_in_file_order():
    lines = readme_tables.render(ROWS_SPEC, ROOT, DOC)
    assert lines[0] == "| row | peak MiB | gradient SQNR (median) |"
    assert lines[2] == "| plain AMP | 9,746 | exact |"  # an infinite SQNR: the exact gradients
    assert lines[3] == "| timm checkpointing | 2,932 | exact |"
    assert lines[4] == "| int8 | 4,201 | 45.2 dB |"
    assert (
        len([line for line in lines if line.startswith("| ")]) == 1 + 7
    )  # the header and DeiT-B's 7 points
    assert lines[-1].startswith("- 2026-12-01, NVIDIA H200, torch 2.11.0+cu130")
    assert "(../benchmarks/results/checkpoint_pareto_gpu_repeats.md)" in lines[-1]


def test_results_doc_is_one_generated_section_per_benchmark():
    """Issue 53: docs/RESULTS.md is current sections whose tables come from one file each."""
    tables = readme_tables.tables_in(RESULTS_DOC)
    rows = [t for t in tables if t.startswith("rows;")]
    assert len(rows) >= 20, tables
    assert {"budget", "compiled"} <= set(tables)
    for heading in (
        "## Coverage by model family",
        "## DeiT training memory",
        "## Eager speed",
        "## CUDA-graphed training",
        "## Kernel bandwidth",
        "## Convolutional",
        "## Language models",
        "## Compressed checkpointing",
        "## Accuracy",
        "## Memory against accuracy",
        "## Compiled",
        "## Training within",
    ):
        assert heading in RESULTS_DOC, heading
    # a section per benchmark, not a journal: no dated section headings, no notes of sessions
    assert not re.search(r"^#+ .*20\d\d-\d\d-\d\d", RESULTS_DOC, re.M)
    for word in ("session", "goal", "issue 40", "this machine"):
        assert word not in RESULTS_DOC.lower(), word


def test_an_altered_cell_of_a_rows_table_fails_naming_it():
    cell = "| deit_small_patch16_224 | mesa | 2,390 |"
    assert RESULTS_DOC.count(cell) == 1
    problems = readme_tables.check(
        RESULTS_DOC.replace(cell, cell.replace("2,390", "2,290")), doc=DOC
    )
    assert len(problems) == 1 and "table 'rows;deit_memory_gpu;" in problems[0], problems


def test_a_bad_rows_spec_is_reported_naming_it():
    for spec, why in (("rows;deit_memory_gpu;;peak_mib", "not FIELD/FORMAT"),
                      ("rows;deit_memory_gpu;model=resnet50;peak_mib/mib", "no row"),
                      ("rows;deit_memory_gpu;peak_mib/mib", "expected rows;FILE")):  # fmt: skip
        text = f"Table:\n\n<!-- table:{spec} -->\n<!-- /table:{spec} -->\n"
        problems = readme_tables.check(text, doc=DOC)
        assert len(problems) == 1 and why in problems[0] and spec in problems[0], problems
        with pytest.raises(ValueError, match=why):
            readme_tables.update(text, doc=DOC)


def test_a_csv_results_file_is_read_as_its_values():
    """benchmarks/ablate.py writes CSV: numbers, booleans and text come back as JSON would."""
    src = readme_tables._Sources(ROOT, DOC)
    rows = src.rows("ablation_gpu")
    assert rows[0]["bits"] == 8 and rows[0]["rounding"] == "nearest" and rows[0]["pareto"] is False
    fig = readme_tables.figure
    spec = "ablation_gpu:bits=4&group_size=128&rounding=nearest&layers=all:memory_reduction:x"
    assert fig(spec, src) == "2.99x"
    assert (
        src.link("ablation_gpu") == "[`ablation_gpu.csv`](../benchmarks/results/ablation_gpu.csv)"
    )
    assert fig("text_accuracy_gpu:config=plain&step=1200:mean(heldout_loss):.4f", src) == "0.9982"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but - and _ dropped,
    spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_a_section_of_the_docs_reach_a_heading():
    docs = {"README.md": README, DOC: RESULTS_DOC, readme_tables.GUIDE: GUIDE,
            "docs/HISTORY.md": (ROOT / "docs/HISTORY.md").read_text()}  # fmt: skip
    anchors = {doc: {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
               for doc, text in docs.items()}  # fmt: skip
    checked = 0
    for doc, text in docs.items():
        for target, anchor in re.findall(r"\]\(([\w./]*\.md)?#([\w-]+)\)", text):
            path = posixpath.normpath(posixpath.join(posixpath.dirname(doc), target or doc))
            path = doc if not target else path
            assert anchor in anchors[path], (doc, target, anchor)
            checked += 1
    assert checked >= 10
