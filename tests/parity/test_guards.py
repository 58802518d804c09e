from parity.guards import MaeRatioLimit, threshold_violations


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


def test_mae_ratio_first_value_is_the_baseline_then_k_times_it_is_the_limit():
    lim = MaeRatioLimit(5.0)
    assert lim.violations({"probe/mae": 0.04}, prefix="probe/") == []  # sets the baseline, never a breach
    assert lim.baseline == 0.04
    assert lim.violations({"parity/mae": 0.03}) == [] and lim.baseline == 0.04  # step 1, lower: kept
    assert lim.violations({"parity/mae": 0.2}) == []  # 5 x 0.04 = 0.2: at the limit is allowed
    assert lim.violations({"parity/mae": 0.21}) == [
        "parity/mae = 0.21 is more than parity.max_mae_ratio = 5 times the run's first mae 0.04 (limit 0.2)"]
    assert lim.violations({"probe/mae": 0.3}, prefix="probe/") == [
        "probe/mae = 0.3 is more than parity.max_mae_ratio = 5 times the run's first mae 0.04 (limit 0.2)"]
    assert lim.baseline == 0.04  # later values never move it


def test_mae_ratio_floor_nan_missing_and_off():
    lim = MaeRatioLimit(5.0)
    lim.violations({"probe/mae": 0.0}, prefix="probe/")  # an exact recipe: 0
    lim.violations({"parity/mae": 0.0})  # and step 1 too
    assert lim.violations({"parity/mae": 5e-4}) == []  # 5 x max(0, floor 1e-4) = 5e-4
    assert lim.violations({"parity/mae": 6e-4}) != []
    assert lim.violations({"parity/mae": float("nan")}) != []
    assert lim.violations({"parity/num_tokens": 0}) == []  # no tokens: no key, nothing to judge
    nan_first = MaeRatioLimit(2.0)
    assert nan_first.violations({"parity/mae": float("nan")}) == [] and nan_first.baseline is None
    off = MaeRatioLimit(None)
    assert off.violations({"parity/mae": 1.0}) == [] and off.violations({"parity/mae": 100.0}) == []


def test_mae_ratio_baseline_from_the_probe_is_raised_by_step_1_only():
    """One probe of a few fixed sequences is noisy: step 1's own mae (same weights, no sync yet) raises the
    baseline if larger; later steps never do, and without a probe the first step's mae is the baseline alone."""
    lim = MaeRatioLimit(5.0)
    lim.violations({"probe/mae": 0.02}, prefix="probe/")
    assert lim.violations({"parity/mae": 0.04}) == [] and lim.baseline == 0.04  # step 1: the larger of the two
    assert lim.violations({"probe/mae": 0.19}, prefix="probe/") == []  # 5 x 0.04
    assert lim.violations({"parity/mae": 0.3}) != [] and lim.baseline == 0.04
    no_probe = MaeRatioLimit(5.0)
    no_probe.violations({"parity/mae": 0.02})
    assert no_probe.violations({"parity/mae": 0.15}) != [] and no_probe.baseline == 0.02  # step 2: judged
    nan_step1 = MaeRatioLimit(5.0)
    nan_step1.violations({"probe/mae": 0.02}, prefix="probe/")
    assert nan_step1.violations({"parity/mae": float("nan")}) != []  # a NaN is a breach, never a baseline
