#![no_main]
//! Fuzz target `mesh_answer`: see `kvroute_fuzz::mesh_answer::run` for what is checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvroute_fuzz::mesh_answer::run(data));
