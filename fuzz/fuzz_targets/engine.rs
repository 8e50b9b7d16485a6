#![no_main]
//! Fuzz target `engine`: see `kvroute_fuzz::engine::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::engine::run(data));
