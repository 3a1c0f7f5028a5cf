"""Code the tests share (no tests here): study builders, started processes, workloads loaded
by name, independent reference computations."""
