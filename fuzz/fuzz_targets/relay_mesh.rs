#![no_main]
//! Fuzz target `relay_mesh`: see `kvroute_fuzz::relay_mesh::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::relay_mesh::run(data));
