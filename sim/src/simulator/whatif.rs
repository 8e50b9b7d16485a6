//! what-if.
