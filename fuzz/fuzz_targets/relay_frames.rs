#![no_main]
//! Fuzz target `relay_frames`: see `kvroute_fuzz::relay_frames::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::relay_frames::run(data));
