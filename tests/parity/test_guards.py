from parity.guards import threshold_violations


def test_violations_name_metric_value_and_limit():
    m = {"parity/mae": 0.05, "parity/kl_k3": 1e-4}
    assert threshold_violations(m) == []
    assert threshold_violations(m, max_mae=0.1, max_kl_k3=1e-3) == []
    v = threshold_violations(m, max_mae=0.01, max_kl_k3=1e-5)
    assert v == ["parity/mae = 0.05 exceeds the recipe's limit 0.01", "parity/kl_k3 = 0.0001 exceeds the recipe's limit 1e-05"]


def test_nan_is_a_breach_and_missing_key_is_not():
    assert threshold_violations({"parity/mae": float("nan")}, max_mae=1.0) == [
        "parity/mae = nan exceeds the recipe's limit 1"]
    assert threshold_violations({"parity/num_tokens": 0}, max_mae=1e-9, max_kl_k3=1e-9) == []


def test_probe_prefix_checks_the_probe_keys_only():
    m = {"parity/mae": 0.5, "probe/mae": 0.001}
    assert threshold_violations(m, max_mae=0.01, prefix="probe/") == []
    assert threshold_violations({"probe/kl_k3": 0.2}, max_kl_k3=0.1, prefix="probe/") == [
        "probe/kl_k3 = 0.2 exceeds the recipe's limit 0.1"]
