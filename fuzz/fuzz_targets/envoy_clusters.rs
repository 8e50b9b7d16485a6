#![no_main]
//! Fuzz target `envoy_clusters`: see `kvroute_fuzz::envoy_clusters::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::envoy_clusters::run(data));
