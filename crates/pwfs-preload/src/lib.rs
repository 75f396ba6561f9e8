//! libpwfs_preload.so: `LD_PRELOAD` it into a program working on a Patchwork mount,
//! and the data calls of its files there go to the mount's daemon over shared memory
//! instead of through FUSE (docs/SHIM.md).
//!
//! The namespace stays with the kernel: open, stat by path, rename, unlink, readdir,
//! mmap, flock go to the mount as before, so every descriptor is a real kernel
//! descriptor. What the shim carries, for a regular file on a Patchwork mount: read,
//! write, pread, pwrite, readv, writev and their p- and v2-variants, lseek (SEEK_END,
//! SEEK_DATA, SEEK_HOLE; the file position itself stays in the kernel), fsync,
//! fdatasync, ftruncate, fallocate, posix_fallocate, fstat and statx/fstatat of the
//! descriptor itself, syncfs and sync. It watches close, close_range, closefrom,
//! fclose, dup2, dup3, fcntl and the open family only to keep its table of
//! descriptors true. Everything else, and every call it cannot carry (no daemon, a
//! descriptor above 65535, a call from inside a signal handler that interrupted the
//! shim, flags it does not know) goes to the kernel, which reaches the same engine.
//!
//! Every exported name is the C library's (`*64`, `__*_chk` and old `__fxstat*`
//! names included) and behaves like it; `# Safety` of each is the C function's.
#![allow(clippy::missing_safety_doc)]

mod client;
mod real;

use client::{classify, request, shim, Fail, Ours};
use libc::{c_char, c_int, c_long, c_uint, c_void, iovec, mode_t, off_t, size_t, ssize_t, FILE};
use pwfs_shim::proto::{Op, Stat, DATA};

/// Linux moves at most this much in one read or write (MAX_RW_COUNT).
const MAX_RW: usize = 0x7fff_f000;

unsafe fn set_errno(e: i32) {
    client::set_errno(e);
}

/// The C result of a carried call: the value, or -1 with errno. None: the kernel does it.
unsafe fn finish(r: Result<i64, Fail>) -> Option<i64> {
    match r {
        Ok(v) => Some(v),
        Err(Fail::Errno(e)) => {
            set_errno(e);
            Some(-1)
        }
        Err(Fail::Kernel) => None,
    }
}

// ---- moving data between the caller's buffers and the channel ---------------

/// A position in a list of buffers.
struct Cursor<'a> {
    iov: &'a [iovec],
    i: usize,
    at: usize,
}

impl Cursor<'_> {
    /// Copy from the buffers into `dst` (as much as fits): bytes copied.
    unsafe fn gather(&mut self, dst: &mut [u8]) -> usize {
        let mut n = 0;
        while n < dst.len() && self.i < self.iov.len() {
            let v = &self.iov[self.i];
            let k = (v.iov_len - self.at).min(dst.len() - n);
            std::ptr::copy_nonoverlapping((v.iov_base as *const u8).add(self.at), dst[n..].as_mut_ptr(), k);
            self.advance(k);
            n += k;
        }
        n
    }

    /// Copy `src` into the buffers.
    unsafe fn scatter(&mut self, src: &[u8]) {
        let mut n = 0;
        while n < src.len() && self.i < self.iov.len() {
            let v = &self.iov[self.i];
            let k = (v.iov_len - self.at).min(src.len() - n);
            std::ptr::copy_nonoverlapping(src[n..].as_ptr(), (v.iov_base as *mut u8).add(self.at), k);
            self.advance(k);
            n += k;
        }
    }

    fn advance(&mut self, k: usize) {
        self.at += k;
        while self.i < self.iov.len() && self.at >= self.iov[self.i].iov_len {
            self.at -= self.iov[self.i].iov_len;
            self.i += 1;
        }
    }
}

/// The total length of `iov` (EINVAL past SSIZE_MAX), capped at MAX_RW.
unsafe fn total(iov: *const iovec, cnt: c_int) -> Result<(&'static [iovec], usize), Fail> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return Err(Fail::Errno(libc::EINVAL));
    }
    let iov: &[iovec] = if cnt == 0 { &[] } else { std::slice::from_raw_parts(iov, cnt as usize) };
    let mut sum: usize = 0;
    for v in iov {
        sum = sum.checked_add(v.iov_len).filter(|s| *s <= isize::MAX as usize).ok_or(Fail::Errno(libc::EINVAL))?;
    }
    Ok((iov, sum.min(MAX_RW)))
}

fn offset(off: i64, len: usize) -> Result<u64, Fail> {
    if off < 0 || off.checked_add(len as i64).is_none() {
        return Err(Fail::Errno(libc::EINVAL));
    }
    Ok(off as u64)
}

/// Read `len` bytes at `off` into `iov`: bytes read (short at end of file).
unsafe fn read_at(o: Ours, iov: &[iovec], len: usize, off: u64) -> Result<usize, Fail> {
    let mut cur = Cursor { iov, i: 0, at: 0 };
    let mut done = 0;
    while done < len {
        let want = (len - done).min(DATA);
        let r = request(o, Op::Read, off + done as u64, want as u64, 0, |_| 0, |_, d, n| cur.scatter(&d[..n]));
        let got = match r {
            Ok((n, _)) => n as usize,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        };
        done += got;
        if got < want {
            break;
        }
    }
    Ok(done)
}

/// Write `len` bytes of `iov` at `off` (the end of file, for an O_APPEND descriptor):
/// (bytes written, the offset after them).
unsafe fn write_at(o: Ours, iov: &[iovec], len: usize, off: u64) -> Result<(usize, u64), Fail> {
    let mut cur = Cursor { iov, i: 0, at: 0 };
    let (mut done, mut end) = (0, off);
    while done < len {
        let want = (len - done).min(DATA);
        let r = request(o, Op::Write, end, want as u64, 0, |d| cur.gather(&mut d[..want]), |_, _, _| ());
        match r {
            Ok((n, at)) => {
                done += n as usize;
                end = at + n as u64;
                // Short (no space for more): the cursor took `want` bytes, and the
                // call returns what was written, as write(2) does.
                if (n as usize) < want {
                    break;
                }
            }
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok((done, end))
}

/// At the file position, which stays in the kernel (shared with dup'ed descriptors
/// and across fork, as it must): read it, move it after.
unsafe fn read_pos(fd: c_int, o: Ours, iov: &[iovec], len: usize) -> Result<usize, Fail> {
    let pos = real::lseek64(fd, 0, libc::SEEK_CUR);
    if pos < 0 {
        return Err(Fail::Kernel);
    }
    let n = read_at(o, iov, len, pos as u64)?;
    real::lseek64(fd, pos + n as i64, libc::SEEK_SET);
    Ok(n)
}

unsafe fn write_pos(fd: c_int, o: Ours, iov: &[iovec], len: usize) -> Result<usize, Fail> {
    let pos = real::lseek64(fd, 0, libc::SEEK_CUR);
    if pos < 0 {
        return Err(Fail::Kernel);
    }
    let (n, end) = write_at(o, iov, len, pos as u64)?;
    real::lseek64(fd, end as i64, libc::SEEK_SET);
    Ok(n)
}

/// A call of zero bytes goes to the kernel, which answers it without a data request
/// and with the errno a carried call could not know without one (EBADF on a descriptor
/// not open for that direction, EINVAL on a negative offset).
fn nothing<T>(total: &Result<(T, usize), Fail>) -> bool {
    matches!(total, Ok((_, 0)))
}

/// The carried form of every read: `off` None is at the file position, which the
/// shim moves only for a descriptor whose description is its own (a shared one's
/// position is the kernel's to serialise: those reads go to the kernel).
unsafe fn do_read(fd: c_int, iov: *const iovec, cnt: c_int, off: Option<i64>) -> Option<ssize_t> {
    shim(|| {
        let o = classify(fd)?;
        if off.is_none() && !o.private {
            return None;
        }
        let total = total(iov, cnt);
        if nothing(&total) {
            return None;
        }
        let r = total.and_then(|(iov, len)| match off {
            None => client::with_position(fd, || read_pos(fd, o, iov, len)),
            Some(off) => read_at(o, iov, len, offset(off, len)?),
        });
        finish(r.map(|n| n as i64))
    })
    .map(|v| v as ssize_t)
}

/// The carried form of every write: at the position as `do_read`, except that an
/// O_APPEND descriptor's writes are carried shared or not (they go to the end, which
/// the daemon picks atomically).
unsafe fn do_write(fd: c_int, iov: *const iovec, cnt: c_int, off: Option<i64>) -> Option<ssize_t> {
    shim(|| {
        let o = classify(fd)?;
        if off.is_none() && !o.private && !o.append {
            return None;
        }
        let total = total(iov, cnt);
        if nothing(&total) {
            return None;
        }
        let r = total.and_then(|(iov, len)| match off {
            None if o.private => client::with_position(fd, || write_pos(fd, o, iov, len)),
            None => write_pos(fd, o, iov, len),
            Some(off) => write_at(o, iov, len, offset(off, len)?).map(|(n, _)| n),
        });
        finish(r.map(|n| n as i64))
    })
    .map(|v| v as ssize_t)
}

fn one(buf: *const c_void, n: size_t) -> iovec {
    iovec { iov_base: buf as *mut c_void, iov_len: n }
}

// ---- reads and writes -----------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    let v = one(buf, n);
    do_read(fd, &v, 1, None).unwrap_or_else(|| real::read(fd, buf, n))
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    let v = one(buf, n);
    do_write(fd, &v, 1, None).unwrap_or_else(|| real::write(fd, buf, n))
}

#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    let v = one(buf, n);
    do_read(fd, &v, 1, Some(off)).unwrap_or_else(|| real::pread64(fd, buf, n, off))
}

#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    pread64(fd, buf, n, off)
}

#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    let v = one(buf, n);
    do_write(fd, &v, 1, Some(off)).unwrap_or_else(|| real::pwrite64(fd, buf, n, off))
}

#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    pwrite64(fd, buf, n, off)
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    do_read(fd, iov, cnt, None).unwrap_or_else(|| real::readv(fd, iov, cnt))
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    do_write(fd, iov, cnt, None).unwrap_or_else(|| real::writev(fd, iov, cnt))
}

#[no_mangle]
pub unsafe extern "C" fn preadv64(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    do_read(fd, iov, cnt, Some(off)).unwrap_or_else(|| real::preadv64(fd, iov, cnt, off))
}

#[no_mangle]
pub unsafe extern "C" fn preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    preadv64(fd, iov, cnt, off)
}

#[no_mangle]
pub unsafe extern "C" fn pwritev64(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    do_write(fd, iov, cnt, Some(off)).unwrap_or_else(|| real::pwritev64(fd, iov, cnt, off))
}

#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    pwritev64(fd, iov, cnt, off)
}

/// preadv2/pwritev2: offset -1 is the file position; any flag (RWF_NOWAIT, RWF_HIPRI,
/// RWF_DSYNC…) sends the call to the kernel, which knows them all.
#[no_mangle]
pub unsafe extern "C" fn preadv64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t {
    let carried = if flags == 0 { do_read(fd, iov, cnt, (off != -1).then_some(off)) } else { None };
    carried.unwrap_or_else(|| real::preadv64v2(fd, iov, cnt, off, flags))
}

#[no_mangle]
pub unsafe extern "C" fn preadv2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t {
    preadv64v2(fd, iov, cnt, off, flags)
}

#[no_mangle]
pub unsafe extern "C" fn pwritev64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t {
    let carried = if flags == 0 { do_write(fd, iov, cnt, (off != -1).then_some(off)) } else { None };
    carried.unwrap_or_else(|| {
        // RWF_APPEND goes to the kernel, which appends at the size it caches: stale
        // after carried writes grew the file (it would write over their end).
        if flags & libc::RWF_APPEND != 0 && shim(|| classify(fd)).is_some() {
            refresh_kernel_size(fd);
        }
        real::pwritev64v2(fd, iov, cnt, off, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn pwritev2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t {
    pwritev64v2(fd, iov, cnt, off, flags)
}

extern "C" {
    fn __chk_fail() -> !;
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        __chk_fail();
    }
    read(fd, buf, n)
}

#[no_mangle]
pub unsafe extern "C" fn __pread64_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        __chk_fail();
    }
    pread64(fd, buf, n, off)
}

#[no_mangle]
pub unsafe extern "C" fn __pread_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t {
    __pread64_chk(fd, buf, n, off, buflen)
}

// ---- position, size, durability -------------------------------------------------

/// lseek: SEEK_SET and SEEK_CUR are the kernel's alone (no request to anyone);
/// SEEK_END needs the size and SEEK_DATA/SEEK_HOLE the file's extents, which the
/// daemon has and the kernel may not.
#[no_mangle]
pub unsafe extern "C" fn lseek64(fd: c_int, off: off_t, whence: c_int) -> off_t {
    let carried = if matches!(whence, libc::SEEK_END | libc::SEEK_DATA | libc::SEEK_HOLE) {
        shim(|| {
            let o = classify(fd)?;
            let seek = || {
                let to = if whence == libc::SEEK_END {
                    client::stat(o).and_then(|s| {
                        (s.size as i64).checked_add(off).filter(|n| *n >= 0).ok_or(Fail::Errno(libc::EINVAL))
                    })
                } else if off < 0 {
                    Err(Fail::Errno(libc::ENXIO))
                } else {
                    // Pages a shared writable mapping dirtied in the kernel reach the
                    // engine first: unwritten, a hole there was data for the mapping's
                    // reader (`cp --sparse` copied zeros).
                    if let Err(e) = write_back_mapped(fd) {
                        return finish(Err(e));
                    }
                    request(o, Op::Seek, off as u64, 0, whence as u64, |_| 0, |_, _, _| ()).map(|(_, at)| at as i64)
                };
                match to {
                    Ok(to) => Some(real::lseek64(fd, to, libc::SEEK_SET)),
                    Err(e) => finish(Err(e)),
                }
            };
            if o.private {
                client::with_position(fd, seek)
            } else {
                seek()
            }
        })
    } else {
        None
    };
    carried.unwrap_or_else(|| real::lseek64(fd, off, whence))
}

#[no_mangle]
pub unsafe extern "C" fn lseek(fd: c_int, off: off_t, whence: c_int) -> off_t {
    lseek64(fd, off, whence)
}

unsafe fn simple(fd: c_int, op: Op, a: u64, b: u64, c: u64) -> Option<c_int> {
    shim(|| {
        let o = classify(fd)?;
        finish(request(o, op, a, b, c, |_| 0, |_, _, _| ()).map(|_| 0))
    })
    .map(|v| v as c_int)
}

#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    carried_fsync(fd, 0).unwrap_or_else(|| real::fsync(fd))
}

#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    carried_fsync(fd, 1).unwrap_or_else(|| real::fdatasync(fd))
}

/// A carried fsync: pages the kernel holds dirty for the file (a shared writable
/// mapping's, even one of another descriptor) are written to the daemon first, or the
/// daemon's commit would not hold them. No request when nothing is dirty.
unsafe fn carried_fsync(fd: c_int, datasync: u64) -> Option<c_int> {
    shim(|| {
        let o = classify(fd)?;
        if let Err(e) = write_back_mapped(fd) {
            return finish(Err(e));
        }
        finish(request(o, Op::Fsync, 0, 0, datasync, |_| 0, |_, _, _| ()).map(|_| 0))
    })
    .map(|v| v as c_int)
}

/// Have the kernel write the file's dirty pages (a shared writable mapping's, of any
/// descriptor) to the daemon and wait for them: one system call that writes nothing
/// when nothing is dirty.
unsafe fn write_back_mapped(fd: c_int) -> Result<(), Fail> {
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    if libc::syscall(libc::SYS_sync_file_range, fd, 0 as off_t, 0 as off_t, flags) != 0 {
        return Err(Fail::Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)));
    }
    Ok(())
}

/// `simple` for a change that drops or moves data (truncate, punch, zero, collapse,
/// insert): the kernel's dirty pages of the file (another process's shared writable
/// mapping) are written first. The invalidation after the change would otherwise
/// write them back on top of it: old bytes in a punched hole, or a truncated file
/// grown again to the end of a page. Best effort: their write-back errors are their
/// writers' to see (at their msync or fsync), not this call's.
unsafe fn simple_laundered(fd: c_int, op: Op, a: u64, b: u64, c: u64) -> Option<c_int> {
    shim(|| {
        let o = classify(fd)?;
        let _ = write_back_mapped(fd);
        finish(request(o, op, a, b, c, |_| 0, |_, _, _| ()).map(|_| 0))
    })
    .map(|v| v as c_int)
}

/// A size change the kernel did not make: its cached size was invalidated (if it had
/// one), but a page fault in a mapping trusts the cached size without asking, and
/// would raise SIGBUS past the old end. One fstat through the kernel refreshes it (a
/// request only when it was invalidated).
unsafe fn refresh_kernel_size(fd: c_int) {
    let mut st: libc::stat64 = std::mem::zeroed();
    real::fstat64(fd, &mut st);
}

#[no_mangle]
pub unsafe extern "C" fn ftruncate64(fd: c_int, len: off_t) -> c_int {
    if len < 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    match simple_laundered(fd, Op::Truncate, len as u64, 0, 0) {
        Some(r) => {
            if r == 0 {
                refresh_kernel_size(fd);
            }
            r
        }
        None => real::ftruncate64(fd, len),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ftruncate(fd: c_int, len: off_t) -> c_int {
    ftruncate64(fd, len)
}

#[no_mangle]
pub unsafe extern "C" fn fallocate64(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    if off < 0 || len <= 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // Only an allocation (mode 0 or KEEP_SIZE) changes no byte.
    let r = match mode & !libc::FALLOC_FL_KEEP_SIZE {
        0 => simple(fd, Op::Fallocate, off as u64, len as u64, mode as u32 as u64),
        _ => simple_laundered(fd, Op::Fallocate, off as u64, len as u64, mode as u32 as u64),
    };
    match r {
        Some(r) => {
            if r == 0 {
                refresh_kernel_size(fd);
            }
            r
        }
        None => real::fallocate64(fd, mode, off, len),
    }
}

#[no_mangle]
pub unsafe extern "C" fn fallocate(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    fallocate64(fd, mode, off, len)
}

/// posix_fallocate answers the error number itself (it does not set errno).
#[no_mangle]
pub unsafe extern "C" fn posix_fallocate64(fd: c_int, off: off_t, len: off_t) -> c_int {
    if off < 0 || len <= 0 {
        return libc::EINVAL;
    }
    let carried = shim(|| {
        let o = classify(fd)?;
        match request(o, Op::Fallocate, off as u64, len as u64, 0, |_| 0, |_, _, _| ()) {
            Ok(_) => {
                refresh_kernel_size(fd);
                Some(0)
            }
            Err(Fail::Errno(e)) => Some(e),
            Err(Fail::Kernel) => None,
        }
    });
    carried.unwrap_or_else(|| real::posix_fallocate64(fd, off, len))
}

#[no_mangle]
pub unsafe extern "C" fn posix_fallocate(fd: c_int, off: off_t, len: off_t) -> c_int {
    posix_fallocate64(fd, off, len)
}

/// sync(2): the kernel first (its dirty pages, from shared mappings and the
/// kernel's own writes, reach the daemons), then every Patchwork mount's daemon
/// commits (the kernel does not tell them).
#[no_mangle]
pub unsafe extern "C" fn sync() {
    libc::syscall(libc::SYS_sync);
    shim(|| {
        for m in client::all_mounts() {
            let _ = client::mount_request(m, Op::Syncfs);
        }
        Some(())
    });
}

/// syncfs(2) of any descriptor on a Patchwork mount (directories too): the kernel's
/// syncfs first (as `sync`), then the daemon's commit.
#[no_mangle]
pub unsafe extern "C" fn syncfs(fd: c_int) -> c_int {
    let kernel = real::syncfs(fd);
    if kernel != 0 {
        return kernel;
    }
    let carried = shim(|| {
        let st = client::fstat_raw(fd)?;
        let m = client::mount_of(st.st_dev)?;
        finish(client::mount_request(m, Op::Syncfs).map(|_| 0))
    });
    carried.map(|v| v as c_int).unwrap_or(0)
}

// ---- attributes ---------------------------------------------------------------

/// The attributes of `fd` if it is carried.
fn carried_stat(fd: c_int) -> Option<Result<(Stat, u64), Fail>> {
    shim(|| {
        let o = classify(fd)?;
        match client::stat(o) {
            Err(Fail::Kernel) => None,
            r => Some(r.map(|s| (s, client::dev_of(o.mount)))),
        }
    })
}

unsafe fn fill_stat64(st: *mut libc::stat64, s: &Stat, dev: u64) {
    let mut out: libc::stat64 = std::mem::zeroed();
    out.st_dev = dev;
    out.st_ino = s.ino;
    out.st_nlink = s.nlink as _;
    out.st_mode = s.mode;
    out.st_uid = s.uid;
    out.st_gid = s.gid;
    out.st_rdev = s.rdev as u64;
    out.st_size = s.size as i64;
    out.st_blksize = s.blksize as _;
    out.st_blocks = s.blocks as i64;
    (out.st_atime, out.st_atime_nsec) = (s.atime.0, s.atime.1 as i64);
    (out.st_mtime, out.st_mtime_nsec) = (s.mtime.0, s.mtime.1 as i64);
    (out.st_ctime, out.st_ctime_nsec) = (s.ctime.0, s.ctime.1 as i64);
    std::ptr::write(st, out);
}

const _: () = assert!(std::mem::size_of::<libc::stat>() == std::mem::size_of::<libc::stat64>());

unsafe fn stat_result(fd: c_int, st: *mut libc::stat64) -> Option<c_int> {
    match carried_stat(fd)? {
        Ok((s, dev)) => {
            fill_stat64(st, &s, dev);
            Some(0)
        }
        Err(e) => finish(Err(e)).map(|v| v as c_int),
    }
}

#[no_mangle]
pub unsafe extern "C" fn fstat64(fd: c_int, st: *mut libc::stat64) -> c_int {
    stat_result(fd, st).unwrap_or_else(|| real::fstat64(fd, st))
}

#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, st: *mut libc::stat) -> c_int {
    fstat64(fd, st as *mut libc::stat64)
}

/// The stat functions of glibc before 2.33, which older binaries still call.
#[no_mangle]
pub unsafe extern "C" fn __fxstat64(_ver: c_int, fd: c_int, st: *mut libc::stat64) -> c_int {
    fstat64(fd, st)
}

#[no_mangle]
pub unsafe extern "C" fn __fxstat(_ver: c_int, fd: c_int, st: *mut libc::stat) -> c_int {
    fstat64(fd, st as *mut libc::stat64)
}

/// fstatat(fd, "", st, AT_EMPTY_PATH) is fstat(fd); anything else is the kernel's.
fn empty_path(path: *const c_char, flags: c_int) -> bool {
    // SAFETY: a non-null path is a C string by contract.
    flags & libc::AT_EMPTY_PATH != 0 && (path.is_null() || unsafe { *path } == 0)
}

#[no_mangle]
pub unsafe extern "C" fn fstatat64(dirfd: c_int, path: *const c_char, st: *mut libc::stat64, flags: c_int) -> c_int {
    let carried = if empty_path(path, flags) { stat_result(dirfd, st) } else { None };
    carried.unwrap_or_else(|| real::fstatat64(dirfd, path, st, flags))
}

#[no_mangle]
pub unsafe extern "C" fn fstatat(dirfd: c_int, path: *const c_char, st: *mut libc::stat, flags: c_int) -> c_int {
    fstatat64(dirfd, path, st as *mut libc::stat64, flags)
}

/// statx of the descriptor itself, for the basic fields (and btime, which the mount
/// does not have either); a caller asking for more (mount id, direct I/O alignment…)
/// gets the kernel's.
#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    st: *mut libc::statx,
) -> c_int {
    let simple_mask = mask & !(libc::STATX_BASIC_STATS | libc::STATX_BTIME) == 0;
    let carried = if empty_path(path, flags) && simple_mask { carried_stat(dirfd) } else { None };
    match carried {
        Some(Ok((s, dev))) => {
            let mut out: libc::statx = std::mem::zeroed();
            out.stx_mask = libc::STATX_BASIC_STATS;
            out.stx_blksize = s.blksize;
            out.stx_nlink = s.nlink;
            out.stx_uid = s.uid;
            out.stx_gid = s.gid;
            out.stx_mode = s.mode as u16;
            out.stx_ino = s.ino;
            out.stx_size = s.size;
            out.stx_blocks = s.blocks;
            (out.stx_atime.tv_sec, out.stx_atime.tv_nsec) = s.atime;
            (out.stx_mtime.tv_sec, out.stx_mtime.tv_nsec) = s.mtime;
            (out.stx_ctime.tv_sec, out.stx_ctime.tv_nsec) = s.ctime;
            out.stx_rdev_major = libc::major(s.rdev as u64);
            out.stx_rdev_minor = libc::minor(s.rdev as u64);
            out.stx_dev_major = libc::major(dev);
            out.stx_dev_minor = libc::minor(dev);
            std::ptr::write(st, out);
            0
        }
        Some(Err(e)) => finish(Err(e)).map(|v| v as c_int).unwrap_or(-1),
        None => real::statx(dirfd, path, flags, mask, st),
    }
}

// ---- mappings --------------------------------------------------------------------

/// mmap is the kernel's; a carried file's size may have changed behind it (an append
/// or truncate through the shim), so its cached size is refreshed first: a mapping of
/// the new end does not fault with SIGBUS.
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    if fd >= 0 && flags & libc::MAP_ANONYMOUS == 0 && shim(|| classify(fd)).is_some() {
        refresh_kernel_size(fd);
        // A shared writable mapping's pages are written back by the kernel, over what
        // the shim wrote meanwhile: this descriptor's I/O goes through the kernel from
        // now on, coherent with the mapping.
        if flags & libc::MAP_SHARED != 0 && prot & libc::PROT_WRITE != 0 {
            shim(|| {
                client::stop_carrying(fd);
                Some(())
            });
        }
    }
    real::mmap64(addr, len, prot, flags, fd, off)
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    mmap64(addr, len, prot, flags, fd, off)
}

// ---- calls the kernel copies for --------------------------------------------------

/// Before the kernel reads or writes a carried file itself (copy_file_range, sendfile,
/// splice): it takes the end of file from its cached size without asking, which a
/// change through the shim made stale (a copy would stop short at the old end).
unsafe fn kernel_uses(fds: &[c_int]) {
    for &fd in fds {
        if fd >= 0 && shim(|| classify(fd)).is_some() {
            refresh_kernel_size(fd);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn copy_file_range(
    fd_in: c_int,
    off_in: *mut off_t,
    fd_out: c_int,
    off_out: *mut off_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    kernel_uses(&[fd_in, fd_out]);
    real::copy_file_range(fd_in, off_in, fd_out, off_out, len, flags)
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, fd_in: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    kernel_uses(&[fd_in]);
    real::sendfile64(out, fd_in, off, count)
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, fd_in: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    sendfile64(out, fd_in, off, count)
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    kernel_uses(&[fd_in, fd_out]);
    real::splice(fd_in, off_in, fd_out, off_out, len, flags)
}

// ---- keeping the table of descriptors true ----------------------------------------

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    // The shim's own socket stays (a program closing every descriptor it did not open).
    if client::is_session_socket(fd) {
        return 0;
    }
    if client::vfork_childs(fd) {
        return real::close(fd);
    }
    // Nothing registers the number until the kernel's close is done (a thread
    // registering it meanwhile would carry the closed file under a reused number).
    let (token, was) = shim(|| Some(client::begin_change(fd))).unwrap_or((0, None));
    let report = shim(|| client::close(was));
    let r = real::close(fd);
    client::end_change(fd, token);
    match report {
        Some(e) if e != 0 && r == 0 => {
            set_errno(e);
            -1
        }
        _ => r,
    }
}

/// close_range(2) around the shim's own sockets.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if first > last {
        set_errno(libc::EINVAL);
        return -1;
    }
    // As close: nothing registers these numbers until the kernel has closed them.
    // (A vfork child closes its own descriptors, not the table's: CPython's subprocess.)
    let tokens = if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && !client::in_vfork_child() {
        shim(|| Some(client::begin_range(first, last))).unwrap_or_default()
    } else {
        Vec::new()
    };
    let r = close_range_around_sockets(first, last, flags);
    client::end_range(&tokens);
    r
}

unsafe fn close_range_around_sockets(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    let mut socks: Vec<c_uint> =
        client::session_sockets().into_iter().map(|s| s as c_uint).filter(|s| (first..=last).contains(s)).collect();
    socks.sort_unstable();
    let mut from = first;
    for sock in socks {
        if sock > from {
            let r = libc::syscall(libc::SYS_close_range, from, sock - 1, flags);
            if r != 0 {
                return r as c_int;
            }
        }
        from = sock + 1;
    }
    if from > last {
        return 0;
    }
    libc::syscall(libc::SYS_close_range, from, last, flags) as c_int
}

/// closefrom(3) (void in glibc), as close_range from `low`.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    close_range(low.max(0) as c_uint, c_uint::MAX, 0);
}

#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut FILE) -> c_int {
    if f.is_null() {
        return real::fclose(f);
    }
    let fd = libc::fileno(f);
    if client::vfork_childs(fd) {
        return real::fclose(f);
    }
    let token = shim(|| {
        let (token, was) = client::begin_change(fd);
        if let Some(o) = was {
            client::release_handle(o);
        }
        Some(token)
    });
    let r = real::fclose(f);
    if let Some(token) = token {
        client::end_change(fd, token);
    }
    r
}

unsafe fn forget(fd: c_int) {
    if fd >= 0 && !client::vfork_childs(fd) {
        shim(|| {
            client::forget(fd);
            Some(())
        });
    }
}

/// `fd` was just opened by the program: a description of its own.
unsafe fn opened(fd: c_int) {
    // (Asked of tracked numbers only, as for close: a getpid system call on every open
    // of every program would cost more than the rare vfork child it catches.)
    if fd >= 0 && !client::vfork_childs(fd) {
        shim(|| {
            client::opened(fd);
            Some(())
        });
    }
}

/// Before a descriptor takes `new`'s number: it is being replaced (`begin_change`;
/// the caller ends it after the kernel call), and if it is one of the shim's sockets,
/// the socket moves elsewhere.
unsafe fn replacing(old: c_int, new: c_int) -> Option<u64> {
    if client::vfork_childs(old) || client::vfork_childs(new) {
        return None;
    }
    shim(|| {
        client::shared(old);
        if old == new {
            return None;
        }
        client::free_number(new);
        let (token, was) = client::begin_change(new);
        if let Some(o) = was {
            client::release_handle(o);
        }
        Some(token)
    })
}

unsafe fn replaced(new: c_int, token: Option<u64>) {
    if let Some(token) = token {
        client::end_change(new, token);
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(old: c_int) -> c_int {
    shim(|| {
        client::shared(old);
        Some(())
    });
    let fd = real::dup(old);
    forget(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let token = replacing(old, new);
    let r = real::dup2(old, new);
    replaced(new, token);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let token = replacing(old, new);
    let r = real::dup3(old, new, flags);
    replaced(new, token);
    r
}

/// fcntl: F_SETFL may change O_APPEND (the handle is registered again); a duplicate
/// gets a number the table must not know yet. The third argument is passed on as the
/// word it is (an int or a pointer).
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    // F_SETFL changing O_APPEND (the one flag F_SETFL can change that a registration
    // keeps; O_SYNC and O_DSYNC it cannot change): registered again once the flags are
    // the kernel's. Every descriptor of the description (dup, fork) sees it, and the
    // ones registered carry the old flag: forgotten once the kernel has the new one
    // (before, a thread could register one again with the old flag meanwhile). Any
    // other F_SETFL (O_NONBLOCK, O_NOATIME...) leaves the registration alone: another
    // thread's request in flight on it goes on, and a descriptor that stopped being
    // carried (mapped) stays so.
    // (No extra F_GETFL for a descriptor known not to be ours: a server's sockets
    // set O_NONBLOCK at every accept.)
    let append_changes = cmd == libc::F_SETFL && !client::known_not_ours(fd) && {
        let before = real::fcntl64(fd, libc::F_GETFL, 0);
        before >= 0 && (before ^ arg as c_int) & libc::O_APPEND != 0
    };
    let token = if append_changes && !client::in_vfork_child() {
        shim(|| {
            let (token, was) = client::begin_change(fd);
            if let Some(o) = was {
                client::release_handle(o);
            }
            Some(token)
        })
    } else {
        None
    };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        shim(|| {
            client::shared(fd);
            Some(())
        });
    }
    let r = real::fcntl64(fd, cmd, arg);
    if append_changes && r == 0 {
        shim(|| {
            client::forget_shared();
            Some(())
        });
    }
    replaced(fd, token);
    if (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && r >= 0 {
        forget(r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    fcntl64(fd, cmd, arg)
}

/// The open family: a new descriptor's number may be one the table still knows (a
/// close the shim did not see, in the C library's own code).
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    let fd = real::open64(path, flags, mode);
    opened(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    open64(path, flags, mode)
}

#[no_mangle]
pub unsafe extern "C" fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    let fd = real::openat64(dirfd, path, flags, mode);
    opened(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    openat64(dirfd, path, flags, mode)
}

#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    let fd = real::__open64_2(path, flags);
    opened(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    __open64_2(path, flags)
}

#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let fd = real::__openat64_2(dirfd, path, flags);
    opened(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    __openat64_2(dirfd, path, flags)
}

#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: mode_t) -> c_int {
    let fd = real::creat64(path, mode);
    opened(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: mode_t) -> c_int {
    creat64(path, mode)
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    let f = real::fopen64(path, mode);
    if !f.is_null() {
        opened(libc::fileno(f));
    }
    f
}

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    fopen64(path, mode)
}

#[no_mangle]
pub unsafe extern "C" fn freopen64(path: *const c_char, mode: *const c_char, old: *mut FILE) -> *mut FILE {
    if !old.is_null() {
        forget(libc::fileno(old));
    }
    let f = real::freopen64(path, mode, old);
    if !f.is_null() {
        opened(libc::fileno(f));
    }
    f
}

#[no_mangle]
pub unsafe extern "C" fn freopen(path: *const c_char, mode: *const c_char, old: *mut FILE) -> *mut FILE {
    freopen64(path, mode, old)
}

// ---- fork, exec, spawn -------------------------------------------------------------

/// Before a program image or child gets this process's descriptors (exec, spawn):
/// every description is shared from then on.
fn sharing() {
    shim(|| {
        client::all_shared();
        Some(())
    });
}

#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    sharing();
    real::execve(path, argv, envp)
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    sharing();
    real::execv(path, argv)
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    sharing();
    real::execvp(file, argv)
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    sharing();
    real::execvpe(file, argv, envp)
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    sharing();
    real::fexecve(fd, argv, envp)
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    sharing();
    real::posix_spawn(pid, path, actions, attr, argv, envp)
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    sharing();
    real::posix_spawnp(pid, file, actions, attr, argv, envp)
}

#[no_mangle]
pub unsafe extern "C" fn system(command: *const c_char) -> c_int {
    sharing();
    real::system(command)
}

#[no_mangle]
pub unsafe extern "C" fn popen(command: *const c_char, mode: *const c_char) -> *mut FILE {
    sharing();
    real::popen(command, mode)
}

extern "C" fn before_fork() {
    client::LOCK.raw_lock();
    // The child inherits every description: their positions are the kernel's now.
    client::all_shared();
}

extern "C" fn after_fork_parent() {
    // SAFETY: before_fork took the lock on this thread.
    unsafe { client::LOCK.raw_unlock() };
}

extern "C" fn after_fork_child() {
    client::after_fork_in_child();
}

extern "C" fn init() {
    client::note_owner();
    // SAFETY: registering three handlers that take and release our own lock.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// Requests this process sent through the shim (tests and `pwfs` tools look it up with
/// dlsym to see whether calls were carried).
#[no_mangle]
pub extern "C" fn pwfs_preload_requests() -> u64 {
    client::REQUESTS.load(std::sync::atomic::Ordering::Relaxed) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_gathers_and_scatters_across_buffers() {
        let (mut a, mut b, mut c) = ([1u8, 2, 3], [0u8; 0], [4u8, 5]);
        let iov = [one(a.as_mut_ptr() as _, 3), one(b.as_mut_ptr() as _, 0), one(c.as_mut_ptr() as _, 2)];
        let mut cur = Cursor { iov: &iov, i: 0, at: 0 };
        let mut d = [0u8; 4];
        // SAFETY: the iovecs point to live arrays above.
        unsafe {
            assert_eq!(cur.gather(&mut d), 4);
            assert_eq!(d, [1, 2, 3, 4]);
            assert_eq!(cur.gather(&mut d), 1);
            assert_eq!(d[0], 5);
            let mut cur = Cursor { iov: &iov, i: 0, at: 0 };
            cur.scatter(&[9, 8]);
            cur.scatter(&[7, 6, 5, 4]);
        }
        assert_eq!((a, c), ([9, 8, 7], [6, 5]));
        assert!(b.is_empty());
        b = [];
        let _ = b;
    }

    #[test]
    fn lengths_and_offsets_are_checked_like_the_kernel() {
        // SAFETY: a null list of zero buffers is never read.
        unsafe {
            assert_eq!(total(std::ptr::null(), -1).err(), Some(Fail::Errno(libc::EINVAL)));
            assert_eq!(total(std::ptr::null(), 0).map(|t| t.1), Ok(0));
            let big = [one(std::ptr::null(), usize::MAX / 2), one(std::ptr::null(), usize::MAX / 2)];
            assert_eq!(total(big.as_ptr(), 2).err(), Some(Fail::Errno(libc::EINVAL)));
            let v = [one(std::ptr::null(), 1 << 40)];
            assert_eq!(total(v.as_ptr(), 1).map(|t| t.1), Ok(MAX_RW));
        }
        assert_eq!(offset(-1, 0), Err(Fail::Errno(libc::EINVAL)));
        assert_eq!(offset(i64::MAX, 1), Err(Fail::Errno(libc::EINVAL)));
        assert_eq!(offset(5, 1), Ok(5));
        assert_eq!(client::unescape(br"/mnt/a\040b\134\"), b"/mnt/a b\\\\".to_vec());
    }
}
