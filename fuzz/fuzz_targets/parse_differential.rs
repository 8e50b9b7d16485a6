#![no_main]
//! Fuzz target `parse_differential`: see `kvroute_fuzz::parse_differential::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::parse_differential::run(data));
