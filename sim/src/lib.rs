//! kvroute-sim: an emulated vLLM fleet and a load generator.
