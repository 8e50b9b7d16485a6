//! kvroute-wasi-run: runs a `wasm32-wasip1` command module (such as a
//! `cargo test` binary) under wasmtime with WASI preview 1.
//!
//! Use it as cargo's runner so the core's unit tests also run as wasm:
//!
//! ```text
//! CARGO_TARGET_WASM32_WASIP1_RUNNER=/path/to/kvroute-wasi-run \
//!     cargo test --target wasm32-wasip1 -p kvroute-core
//! ```
//!
//! Arguments after the module path go to the module (argv[0] is the module's
//! file name). Stdio and environment are inherited; the current directory is
//! preopened as `.` and `/` read-only as `/`, so tests that read files by a
//! relative or absolute path work. The exit code is the module's.

use anyhow::{anyhow, bail, Result};
use wasmtime::{Engine, Linker, Module, Store};
use wasmtime_wasi::p1::{self, WasiP1Ctx};
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

fn run() -> Result<i32> {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        bail!("usage: kvroute-wasi-run MODULE.wasm [ARGS...]");
    };
    let module_args: Vec<String> = std::iter::once(
        std::path::Path::new(&path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.clone()),
    )
    .chain(args)
    .collect();

    let engine = Engine::default();
    let module = Module::from_file(&engine, &path)
        .map_err(|e| anyhow!("cannot load {path} as a wasm module: {e:?}"))?;
    let mut linker: Linker<WasiP1Ctx> = Linker::new(&engine);
    p1::add_to_linker_sync(&mut linker, |ctx| ctx).map_err(|e| anyhow!("{e:?}"))?;

    let mut builder = WasiCtxBuilder::new();
    builder.inherit_stdio().inherit_env().args(&module_args);
    builder
        .preopened_dir(".", ".", FsPerms::ReadWrite)
        .map_err(|e| anyhow!("cannot preopen the current directory: {e:?}"))?;
    builder
        .preopened_dir("/", "/", FsPerms::ReadOnly)
        .map_err(|e| anyhow!("cannot preopen /: {e:?}"))?;
    let mut store = Store::new(&engine, builder.build_p1());

    let instance = linker
        .instantiate(&mut store, &module)
        .map_err(|e| anyhow!("cannot instantiate {path}: {e:?}"))?;
    let start = instance
        .get_typed_func::<(), ()>(&mut store, "_start")
        .map_err(|_| anyhow!("{path} is not a WASI command (no _start export)"))?;
    match start.call(&mut store, ()) {
        Ok(()) => Ok(0),
        Err(e) => match e.downcast_ref::<I32Exit>() {
            Some(exit) => Ok(exit.0),
            // The wasm backtrace is useful; the host's own Rust backtrace
            // (present when RUST_BACKTRACE is set) is noise here.
            None => {
                let text = format!("{e:?}");
                let text = text.split("\nStack backtrace:").next().unwrap_or("");
                Err(anyhow!("{path} trapped: {text}"))
            }
        },
    }
}

fn main() {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("kvroute-wasi-run: {e:?}");
            // 101 is what a failed Rust test binary returns.
            std::process::exit(101);
        }
    }
}
