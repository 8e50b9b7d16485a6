#![no_main]
//! Fuzz target `offpath`: see `kvroute_fuzz::offpath::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::offpath::run(data));
