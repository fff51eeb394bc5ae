"""LeanHive's test suite, in folders that mirror the code (a package, so module names stay unique).

What the tests share with the benchmarks is the test-bed package ``benchmarks.testbed``; ``tests.support`` holds
the helpers only tests use."""
