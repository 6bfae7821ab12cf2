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
