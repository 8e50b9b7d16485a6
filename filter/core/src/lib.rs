//! kvroute core.
