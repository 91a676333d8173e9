from tandem.service.engine.timing import IdleTracker


def test_idle_fraction_over_a_sliding_window():
    t = IdleTracker(window_s=10.0)
    assert t.idle_fraction(now=100.0) == 1.0
    t.record(95.0, 97.0)
    t.record(98.0, 99.0)
    assert abs(t.idle_fraction(now=100.0) - 0.7) < 1e-9
    assert abs(t.idle_fraction(now=106.0) - 0.8) < 1e-9  # the first step slid half out of the window
    assert t.idle_fraction(now=200.0) == 1.0
