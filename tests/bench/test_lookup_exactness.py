"""bench.lookup_exactness: lookup rounds against plain decoding's greedy tokens on a random model."""

from bench import lookup_exactness


def test_fp32_lookup_rounds_rectangular_and_allotted_give_plain_decoding_s_tokens(capsys):
    rows = lookup_exactness.run(("float32",), ("sdpa",), requests=4, tokens=40, batch=4)
    assert [(r["rounds"], r["tokens"]) for r in rows] == [("rectangular", 160), ("allotted", 160)]
    for r in rows:
        assert r["same"] == r["tokens"] and r["first_divergence"] == [None] * 4, r
    lookup_exactness.main(["--dtypes", "float32", "--requests", "2", "--tokens", "12"])
    table = capsys.readouterr().out.splitlines()
    assert "| float32 | sdpa | allotted | 24 / 24 | [None, None] |" in table
