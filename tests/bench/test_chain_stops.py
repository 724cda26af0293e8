"""bench.chain_stops on a tiny random model: the same tokens either way, fewer rounds launched unchained when chains
regroup."""

from bench.chain_stops import count


def test_regrouped_chains_launch_fewer_rounds_unchained_for_the_same_tokens(tiny):
    small = tiny.tiny_vocab_target(8, num_layers=2, seed=3)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3], [4, 6], [3, 1, 4, 1], [6, 6], [0, 5, 2]]
    on = count(small, prompts, 24, batch=3, ahead=2, regroup=True)
    off = count(small, prompts, 24, batch=3, ahead=2, regroup=False)
    assert on["_outs"] == off["_outs"] and on["tokens"] == off["tokens"] == 8 * 24
    assert off["rounds_regrouped"] == 0 < on["rounds_regrouped"]
    assert on["rounds_unchained"] < off["rounds_unchained"] <= off["steps"]
