#![no_main]
//! Fuzz target `parse_request`: see `kvroute_fuzz::check_parse` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::check_parse(data));
