//! The conformance suite every store passes (feature `test-util`).
