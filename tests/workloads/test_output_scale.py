"""output_scale keeps outputs long while prompts shrink (small CPU runs still measure decode and speculation)."""

from kvscope.workloads.generate import generate_from_file


def test_output_scale_changes_outputs_only(tiny_model_dir):
    small = generate_from_file("agent-coding", tiny_model_dir, seed=2, scale=0.02, sessions=3, max_context=100000)
    longer = generate_from_file("agent-coding", tiny_model_dir, seed=2, scale=0.02, sessions=3, max_context=100000,
                                output_scale=0.3)
    assert longer.requests["output_tokens"].median() > 5 * small.requests["output_tokens"].median()
    # the first prompt of every session (system + tools + task) does not depend on output sizes
    firsts = lambda t: t.requests[t.requests["step"] == 0]["prompt_tokens"].tolist()  # noqa: E731
    assert firsts(small) == firsts(longer)
    assert longer.meta["spec"]["output_scale"] == 0.3
