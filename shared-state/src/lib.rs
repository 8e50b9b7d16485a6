//! shared state
