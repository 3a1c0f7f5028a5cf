"""Code the tests share: study builders, processes, workloads and fixtures' helpers (no tests here)."""
