//! The WASI preview 1 functions Envoy gives a proxy-wasm VM, and no more.
//!
//! proxy-wasm-cpp-host implements a small set: `fd_write` on stdout/stderr
//! (turned into info / error log lines, trailing newline dropped),
//! `fd_fdstat_get` and `fd_filestat_get` on 1 and 2, environment variables from the VM config,
//! empty args, the wall clock, random bytes, and stubs that refuse files.
//! A module that imports anything else fails to instantiate here, as it
//! would fail to load in Envoy.
//!
//! Differences, on purpose: `random_get` is seeded (runs repeat), and both
//! clocks read the manual clock.

use crate::env_imports::{finish, read, write, write_u32, write_u64, Fail, C};
use crate::vm_state::VmState;
use wasmtime::Linker;

const ESUCCESS: i32 = 0;
const EBADF: i32 = 8;
const ENOSYS: i32 = 52;
const ENOTSUP: i32 = 58;
const ESPIPE: i32 = 70;
const EFAULT: i32 = 21;

fn errno(r: Result<(), Fail>) -> wasmtime::Result<i32> {
    match finish(r) {
        Ok(0) => Ok(ESUCCESS),
        Ok(_) => Ok(EFAULT),
        Err(trap) => Err(trap),
    }
}

fn errno_with(body: impl FnOnce() -> Result<(), Fail>) -> wasmtime::Result<i32> {
    errno(body())
}

pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let m = "wasi_snapshot_preview1";
    linker.func_wrap(
        m,
        "fd_write",
        |mut c: C, fd: i32, iovs: i32, n: i32, out: i32| {
            let level = match fd {
                1 => 2u32,
                2 => 4u32,
                _ => return Ok(EBADF),
            };
            errno_with(|| {
                let mut text = Vec::new();
                for i in 0..n {
                    let iov = read(&mut c, iovs + i * 8, 8)?;
                    let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                    let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                    text.extend_from_slice(&read(&mut c, ptr, len)?);
                }
                let written = text.len() as u32;
                if text.last() == Some(&b'\n') {
                    text.pop();
                }
                if !text.is_empty() {
                    let name = c.data().name.clone();
                    let line = String::from_utf8_lossy(&text).into_owned();
                    c.data().world.borrow_mut().log(&name, level, line);
                }
                write_u32(&mut c, out, written)
            })
        },
    )?;
    linker.func_wrap(m, "fd_read", |_c: C, _: i32, _: i32, _: i32, _: i32| {
        Ok(ENOSYS)
    })?;
    linker.func_wrap(m, "fd_seek", |_c: C, _: i32, _: i64, _: i32, _: i32| {
        Ok(ESPIPE)
    })?;
    linker.func_wrap(m, "fd_close", |_c: C, _: i32| Ok(ESUCCESS))?;
    linker.func_wrap(m, "fd_fdstat_get", |mut c: C, fd: i32, out: i32| {
        if fd != 1 && fd != 2 {
            return Ok(EBADF);
        }
        // 24 bytes: filetype, flags, rights_base = FD_WRITE (64), inheriting.
        let mut stat = [0u8; 24];
        stat[8..16].copy_from_slice(&64u64.to_le_bytes());
        errno(write(&mut c, out, &stat))
    })?;
    linker.func_wrap(m, "fd_fdstat_set_flags", |_c: C, _: i32, _: i32| Ok(ENOSYS))?;
    // proxy-wasm-cpp-host's fd_filestat_get: stdout and stderr are
    // character devices of size 0; other descriptors do not exist. Rust's
    // std imports it as soon as a module can reach `std::fs` (the
    // `tokenizers` crate can).
    linker.func_wrap(m, "fd_filestat_get", |mut c: C, fd: i32, out: i32| {
        if fd != 1 && fd != 2 {
            return Ok(EBADF);
        }
        // 64 bytes: dev, ino, filetype (u8 at 16; 2 = character device), nlink, size, atim, mtim, ctim.
        let mut stat = [0u8; 64];
        stat[16] = 2;
        errno(write(&mut c, out, &stat))
    })?;
    linker.func_wrap(m, "fd_prestat_get", |_c: C, _: i32, _: i32| Ok(EBADF))?;
    linker.func_wrap(m, "fd_prestat_dir_name", |_c: C, _: i32, _: i32, _: i32| {
        Ok(ENOSYS)
    })?;
    linker.func_wrap(
        m,
        "path_open",
        |_c: C, _: i32, _: i32, _: i32, _: i32, _: i32, _: i64, _: i64, _: i32, _: i32| Ok(ENOSYS),
    )?;
    linker.func_wrap(m, "environ_sizes_get", |mut c: C, count: i32, size: i32| {
        let env = c.data().env.clone();
        let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        errno_with(|| {
            write_u32(&mut c, count, env.len() as u32)?;
            write_u32(&mut c, size, bytes as u32)
        })
    })?;
    linker.func_wrap(
        m,
        "environ_get",
        |mut c: C, mut array: i32, mut buf: i32| {
            let env = c.data().env.clone();
            errno_with(|| {
                for (k, v) in env {
                    write_u32(&mut c, array, buf as u32)?;
                    let entry = format!("{k}={v}\0");
                    write(&mut c, buf, entry.as_bytes())?;
                    buf += entry.len() as i32;
                    array += 4;
                }
                Ok(())
            })
        },
    )?;
    linker.func_wrap(m, "args_sizes_get", |mut c: C, argc: i32, size: i32| {
        errno_with(|| {
            write_u32(&mut c, argc, 0)?;
            write_u32(&mut c, size, 0)
        })
    })?;
    linker.func_wrap(m, "args_get", |_c: C, _: i32, _: i32| Ok(ESUCCESS))?;
    linker.func_wrap(
        m,
        "clock_time_get",
        |mut c: C, id: i32, _prec: i64, out: i32| {
            if id != 0 && id != 1 {
                return Ok(ENOTSUP);
            }
            let now = c.data().world.borrow().now_ns;
            errno(write_u64(&mut c, out, now))
        },
    )?;
    linker.func_wrap(m, "clock_res_get", |mut c: C, _id: i32, out: i32| {
        errno(write_u64(&mut c, out, 1))
    })?;
    linker.func_wrap(m, "random_get", |mut c: C, ptr: i32, len: i32| {
        let mut bytes = Vec::with_capacity(len as usize);
        while bytes.len() < len as usize {
            bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
        }
        bytes.truncate(len as usize);
        errno(write(&mut c, ptr, &bytes))
    })?;
    linker.func_wrap(m, "proc_exit", |_c: C, code: i32| -> wasmtime::Result<()> {
        Err(wasmtime::Error::msg(format!(
            "module called proc_exit({code}); Envoy treats this as a VM failure"
        )))
    })?;
    linker.func_wrap(m, "sched_yield", |_c: C| Ok(ESUCCESS))?;
    linker.func_wrap(m, "poll_oneoff", |_c: C, _: i32, _: i32, _: i32, _: i32| {
        Ok(ENOSYS)
    })?;
    Ok(())
}
