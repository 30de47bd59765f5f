"""On PYTHONPATH (with tests/helpers) in a test's subprocess: log every global batch drawn (batch_log)."""
import os

if os.environ.get("JAXTRAIN_TEST_BATCH_LOG"):
    import batch_log

    batch_log.install(os.environ["JAXTRAIN_TEST_BATCH_LOG"])
