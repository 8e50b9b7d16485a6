#![no_main]
//! Fuzz target `vllm_metrics`: see `kvroute_fuzz::vllm_metrics::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::vllm_metrics::run(data));
