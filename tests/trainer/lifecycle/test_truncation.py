from trainer.lifecycle.truncation import TruncationWatch


def test_warns_once_past_the_threshold_again_if_it_persists_and_names_the_key():
    w = TruncationWatch(threshold=0.5, again_after=3)
    said = {s: w.check(s, f, 24) for s, f in [(1, 0.2), (2, 1.0), (3, 1.0), (4, 0.9), (5, 1.0), (6, 1.0), (7, 0.1),
                                              (8, 0.8)]}
    assert [s for s, msg in said.items() if msg] == [2, 5, 8]
    assert "rollout.max_new_tokens = 24" in said[2] and "100%" in said[2]
    assert w.check(9, None, 24) is None
