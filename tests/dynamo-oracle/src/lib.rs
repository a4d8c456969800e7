//! Empty: the proofs are the integration tests under tests/.
