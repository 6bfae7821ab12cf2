"""A learner's debugging print cannot fail grading: the exercise's learner cells ignore their output."""
import nbformat

from mpcourse.course.exercises import IGNORE_OUTPUT, make_exercise


def _solution():
    code = nbformat.v4.new_code_cell
    return nbformat.v4.new_notebook(cells=[
        code("import torch"),
        code("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION"),
        code("print(f(1))"),                                   # calls the learner's function
        code("from g import check\ncheck(f)", metadata={"tags": ["check"]}),
        code("print(f_other)"),                               # another name: stays strict
    ])


def test_learner_cells_are_tagged_to_ignore_output_and_the_rest_stay_strict():
    ex = make_exercise(_solution())
    tagged = [IGNORE_OUTPUT in c.metadata.get("tags", []) for c in ex.cells]
    assert tagged == [False, True, True, True, False]
    assert "NotImplementedError" in ex.cells[1].source        # the shipped stub still raises, so it fails
    assert ex.cells[3].metadata["tags"] == ["check", IGNORE_OUTPUT]


def test_make_exercise_is_idempotent_on_tags():
    ex = make_exercise(_solution())
    again = make_exercise(_solution())
    assert [c.metadata.get("tags") for c in ex.cells] == [c.metadata.get("tags") for c in again.cells]


def _with_outputs(nb):
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="answer\n")]
            cell.execution_count = 1
    return nb


def test_no_output_of_the_learners_code_is_kept_even_through_a_variable():
    code = nbformat.v4.new_code_cell
    nb = _with_outputs(nbformat.v4.new_notebook(cells=[
        code("import torch\nprint(torch.__version__)"),           # the lesson's own cell: output kept
        code("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION"),
        code("q, r = f(1), 2"),                                   # computes with the learner's function
        code("print(q)"),                                         # shows that value: no output either
        code("for row in [q]:\n    total = row"),                  # a loop over it
        code("total"),                                            # ... and a name bound in that loop
        code("from g import check\ncheck(f)", metadata={"tags": ["check"]}),
        code("print(other)"),                                     # unrelated: output kept
    ]))
    ex = make_exercise(nb)
    kept = [bool(c.outputs) for c in ex.cells]
    assert kept == [True, False, False, False, False, False, False, True]


def test_shipped_exercises_store_no_output_of_the_learners_code():
    """Every shipped exercise: a cell that runs the learner's code stores nothing, and no stored output
    anywhere holds a grader's verdict."""
    from mpcourse.course.exercises import ROOT, exercise_pairs, runs_learner_code

    for sol_path, ex_path in exercise_pairs(ROOT):
        ex, sol = nbformat.read(ex_path, as_version=4), nbformat.read(sol_path, as_version=4)
        flags = runs_learner_code(sol.cells)                  # the exercise has stubs: read the names from the solution
        assert len(flags) == len(ex.cells) and sum(flags) > 1
        for i, (cell, runs) in enumerate(zip(ex.cells, flags)):
            if cell.cell_type != "code":
                continue
            text = "".join(o.get("text", "") + str(o.get("data", "")) for o in cell.outputs)
            assert "PASS" not in text, f"{ex_path.name} cell {i} stores a PASS verdict"
            if runs or "check" in cell.metadata.get("tags", []):
                assert not cell.outputs, f"{ex_path.name} cell {i} runs the learner's code and stores an output"
