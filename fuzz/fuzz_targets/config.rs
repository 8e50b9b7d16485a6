#![no_main]
//! Fuzz target `config`: see `kvroute_fuzz::check_config` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::check_config(data));
