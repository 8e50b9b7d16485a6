#![no_main]
//! Fuzz target `kv_events`: see `kvroute_fuzz::kv_events::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::kv_events::run(data));
