"""`make bench`: the service against hand-written baselines, as ratios measured in one run."""
