//! pwfs-capi: the C ABI of the engine, for programs that embed Patchwork over an image
//! they own (`libpwfs.so`, `libpwfs.a`, `include/pwfs.h`). LevelDB's `c.h` is the model.
//!
//! Interface (the header's opening comment says the same to C callers):
//! - Opaque handles: `struct pwfs_fs` (a mounted image, from `pwfs_mount`, freed by
//!   `pwfs_unmount`), `struct pwfs_file` (`pwfs_open` / `pwfs_close`) and `struct
//!   pwfs_dir` (`pwfs_opendir` / `pwfs_closedir`). Every handle is freed by its close
//!   function, also when that function reports an error; `pwfs_unmount` refuses with
//!   EBUSY (and keeps the handle) while files or directories are open on it.
//! - Names and data are pointer+length pairs; paths need no NUL and may hold none.
//! - The last parameter of every call that can fail is `int *err`: set to 0 on
//!   success, to an errno value (the host's `<errno.h>`) on failure, when the call
//!   returns -1 (or NULL). `err` may be NULL. Flags and modes are the host's: `O_*`
//!   (`<fcntl.h>`), `SEEK_*`, `FALLOC_FL_*` (`<linux/falloc.h>`), `DT_*`, `S_IF*`.
//! - Nothing panics across the boundary: a panic in the engine is caught and reported
//!   as EIO. A NULL handle is EINVAL; a NULL buffer with a nonzero length is EFAULT.
//! - Threads: a `pwfs_fs` and a `pwfs_file` may be used from several threads at once
//!   (the engine's `Fs` and `File` are `Send + Sync`; `pwfs_read`/`pwfs_write`
//!   serialise on the handle's position, `pwfs_pread`/`pwfs_pwrite` do not). A
//!   `pwfs_dir` is used by one thread at a time. No call may race with the close of the
//!   handle it uses.
//!
//! The calls are thin: a read or write converts its arguments and calls the engine's
//! `File::read_at`/`write_at` with the caller's buffer; it allocates nothing itself.
//!
//! Every `pub unsafe extern "C" fn` has one safety contract, the header's: pointers are
//! valid for the lengths given and handles came from this library and are not closed.

// The C names are the ABI's: `pwfs_fs`, not `PwfsFs`.
#![allow(non_camel_case_types)]
// The safety contract is written once, above and in the header, not on each function.
#![allow(clippy::missing_safety_doc)]

use engine::{
    Config, DirEntry, Error, FetchPolicy, File, FileType, Fs, Metadata, MkfsOptions, MountCheck, OpenOptions,
};
use libc::{c_char, c_int, c_void, size_t, ssize_t};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

// What the thread-safety promise rests on.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Fs>();
    send_sync::<File>();
    const fn send<T: Send>() {}
    send::<DirEntry>();
};

/// A mounted image. Opaque to C.
pub struct pwfs_fs {
    fs: Fs,
    /// Files and directories open on it: `pwfs_unmount` is EBUSY while any are.
    open: Arc<AtomicUsize>,
}

/// An open file (or directory opened with `pwfs_open`). Opaque to C.
pub struct pwfs_file {
    file: File,
    open: Arc<AtomicUsize>,
}

/// A directory being listed. Opaque to C.
pub struct pwfs_dir {
    fs: Fs,
    /// The directory, held open.
    held: File,
    /// The offset to read the next batch from (the engine's stable offsets).
    next: u64,
    /// The current batch; each name carries a NUL after its bytes.
    batch: Vec<DirEntry>,
    at: usize,
    done: bool,
    open: Arc<AtomicUsize>,
}

/// Attributes of a file (`pwfs_stat`, `pwfs_lstat`, `pwfs_fstat`). Fixed-width fields;
/// `mode` is `st_mode` (type and permission bits, `S_IF*`), `blocks` counts 512-byte
/// units as `st_blocks`. Times are seconds and nanoseconds since the epoch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct pwfs_stat {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime_sec: i64,
    pub mtime_sec: i64,
    pub ctime_sec: i64,
    pub atime_nsec: u32,
    pub mtime_nsec: u32,
    pub ctime_nsec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub generation: u32,
}

/// One directory entry from `pwfs_readdir`. `name` points at `name_len` bytes followed
/// by a NUL (so `%s` works); it stays valid until the next `pwfs_readdir` or
/// `pwfs_closedir` on the same directory. `type` is a `DT_*` value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct pwfs_dirent {
    pub ino: u64,
    pub name: *const c_char,
    pub name_len: size_t,
    pub r#type: u32,
}

/// Entries fetched from the engine per batch in `pwfs_readdir`.
const DIR_BATCH: usize = 128;

type Res<T> = std::result::Result<T, c_int>;

/// An offset, size or length from C: above INT64_MAX it is a negative `off_t` the
/// caller converted, and EINVAL, as Linux answers for one.
fn file_offset(n: u64) -> Res<u64> {
    if n > i64::MAX as u64 {
        return Err(libc::EINVAL);
    }
    Ok(n)
}

/// Takes a closed handle off its file system's count when dropped, also while a panic
/// in the close unwinds (`pwfs_unmount` would otherwise say EBUSY for ever).
struct Uncount(Arc<AtomicUsize>);

impl Drop for Uncount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn errno(e: Error) -> c_int {
    e.errno()
}

/// Run `body`, catching any panic (EIO), and report its outcome through `err`:
/// its value and 0, or `fail` and the errno.
fn call<T>(err: *mut c_int, fail: T, body: impl FnOnce() -> Res<T>) -> T {
    let out = panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or(Err(libc::EIO));
    let (value, code) = match out {
        Ok(v) => (v, 0),
        Err(code) => (fail, code),
    };
    if !err.is_null() {
        // SAFETY: the caller passes NULL or a valid int (the header's contract).
        unsafe { *err = code };
    }
    value
}

/// A handle the caller passed: EINVAL when NULL.
unsafe fn handle<'a, T>(p: *const T) -> Res<&'a T> {
    // SAFETY: non-NULL handles came from this library and are not closed (contract).
    unsafe { p.as_ref() }.ok_or(libc::EINVAL)
}

/// `len` bytes at `p`: EFAULT for NULL with a nonzero length, EINVAL past isize::MAX.
unsafe fn bytes<'a>(p: *const c_void, len: size_t) -> Res<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(libc::EFAULT);
    }
    if len > isize::MAX as usize {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's buffer is valid for `len` bytes (contract).
    Ok(unsafe { std::slice::from_raw_parts(p as *const u8, len) })
}

unsafe fn bytes_mut<'a>(p: *mut c_void, len: size_t) -> Res<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(libc::EFAULT);
    }
    if len > isize::MAX as usize {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's buffer is valid for `len` bytes and not shared (contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) })
}

/// A path: bytes without NUL (EINVAL: a NUL inside is a length bug in the caller).
unsafe fn path<'a>(p: *const c_char, len: size_t) -> Res<&'a [u8]> {
    // SAFETY: as `bytes`.
    let b = unsafe { bytes(p as *const c_void, len)? };
    if b.contains(&0) {
        return Err(libc::EINVAL);
    }
    Ok(b)
}

/// A host path (the image): as `path`, not empty.
unsafe fn host_path<'a>(p: *const c_char, len: size_t) -> Res<&'a Path> {
    // SAFETY: as `bytes`.
    let b = unsafe { path(p, len)? };
    if b.is_empty() {
        return Err(libc::ENOENT);
    }
    Ok(Path::new(OsStr::from_bytes(b)))
}

/// The items of a `key=value,flag` options string.
fn options(s: &[u8]) -> Res<Vec<(&str, Option<&str>)>> {
    let s = std::str::from_utf8(s).map_err(|_| libc::EINVAL)?;
    Ok(s.split(',')
        .filter(|i| !i.is_empty())
        .map(|i| i.split_once('=').map_or((i, None), |(k, v)| (k, Some(v))))
        .collect())
}

/// A size with an optional K, M, G or T suffix (powers of 1024), as `pwfs mount`.
fn size(s: &str) -> Res<u64> {
    let (num, shift) = match s.as_bytes().last().map(u8::to_ascii_uppercase) {
        Some(b'K') => (&s[..s.len() - 1], 10),
        Some(b'M') => (&s[..s.len() - 1], 20),
        Some(b'G') => (&s[..s.len() - 1], 30),
        Some(b'T') => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|_| libc::EINVAL)?;
    n.checked_mul(1 << shift).ok_or(libc::EINVAL)
}

fn number(s: &str) -> Res<u64> {
    s.parse().map_err(|_| libc::EINVAL)
}

/// The mount options: `cache=SIZE`, `fetch=blocking|async-fg|async-bg|lazy`, `ro`/`rw`,
/// `check` (full check first)/`nocheck`, `atime`/`noatime`, `commit=SECONDS` (0: no
/// background commits). Anything else is EINVAL.
fn mount_config(opts: &[u8]) -> Res<Config> {
    let mut c = Config::default();
    for (key, value) in options(opts)? {
        match (key, value) {
            ("cache", Some(v)) => c.cache_bytes = size(v)?,
            ("fetch", Some(v)) => {
                c.fetch = match v {
                    "blocking" => FetchPolicy::Blocking,
                    "async-fg" => FetchPolicy::AsyncForeground,
                    "async-bg" => FetchPolicy::AsyncBackground,
                    "lazy" => FetchPolicy::Lazy,
                    _ => return Err(libc::EINVAL),
                }
            }
            ("ro", None) => c.read_only = true,
            ("rw", None) => c.read_only = false,
            ("check", None) => c.check_on_mount = MountCheck::Always,
            ("nocheck", None) => c.check_on_mount = MountCheck::Never,
            ("atime", None) => c.atime = true,
            ("noatime", None) => c.atime = false,
            ("commit", Some(v)) => {
                let secs = number(v)?;
                c.writeback_interval = (secs > 0).then(|| Duration::from_secs(secs));
            }
            _ => return Err(libc::EINVAL),
        }
    }
    Ok(c)
}

/// The mkfs options: `inodes=N`, `journal_blocks=N`.
fn mkfs_options(opts: &[u8]) -> Res<MkfsOptions> {
    let mut o = MkfsOptions::default();
    for (key, value) in options(opts)? {
        match (key, value) {
            ("inodes", Some(v)) => o.inodes = Some(number(v)?),
            ("journal_blocks", Some(v)) => o.journal_blocks = Some(number(v)?),
            _ => return Err(libc::EINVAL),
        }
    }
    Ok(o)
}

fn dirent_type(kind: FileType) -> u32 {
    (match kind {
        FileType::File => libc::DT_REG,
        FileType::Directory => libc::DT_DIR,
        FileType::Symlink => libc::DT_LNK,
        FileType::Fifo => libc::DT_FIFO,
        FileType::CharDevice => libc::DT_CHR,
        FileType::BlockDevice => libc::DT_BLK,
        FileType::Socket => libc::DT_SOCK,
    }) as u32
}

fn to_stat(md: &Metadata) -> pwfs_stat {
    pwfs_stat {
        ino: md.ino,
        size: md.size,
        blocks: md.blocks,
        atime_sec: md.atime.sec,
        mtime_sec: md.mtime.sec,
        ctime_sec: md.ctime.sec,
        atime_nsec: md.atime.nsec,
        mtime_nsec: md.mtime.nsec,
        ctime_nsec: md.ctime.nsec,
        mode: md.mode,
        nlink: md.nlink,
        uid: md.uid,
        gid: md.gid,
        rdev: md.rdev,
        blksize: md.blksize,
        generation: md.generation,
    }
}

/// Store `md` in the caller's `out`.
unsafe fn put_stat(out: *mut pwfs_stat, md: &Metadata) -> Res<()> {
    if out.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: `out` points at a `pwfs_stat` the caller owns (contract).
    unsafe { out.write(to_stat(md)) };
    Ok(())
}

// ---- Images and mounts ----

/// Create (or reuse) the image file `image` of `size_bytes` bytes (rounded down to
/// the block size) and format it; everything on it is lost. `options` (may be empty):
/// `inodes=N`, `journal_blocks=N`. Returns 0, or -1 with `*err` set.
#[no_mangle]
pub unsafe extern "C" fn pwfs_mkfs(
    image: *const c_char,
    image_len: size_t,
    size_bytes: u64,
    options: *const c_char,
    options_len: size_t,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's pointers and lengths (contract).
        let (image, opts) = unsafe { (host_path(image, image_len)?, bytes(options as *const c_void, options_len)?) };
        let opts = mkfs_options(opts)?;
        engine::mkfs_image(image, size_bytes, &opts).map_err(errno)?;
        Ok(0)
    })
}

/// Mount the image file or block device `image` (locked exclusively; shared with
/// `ro`). `options` (may be empty) is a comma-separated list: `cache=SIZE` (bytes of
/// file data cached, K/M/G suffixes; default 256M), `fetch=blocking|async-fg|async-bg|
/// lazy` (how partial writes of uncached pages get their page), `ro`, `check` (run
/// the full check first) or `nocheck`, `atime` (relatime updates; default noatime),
/// `commit=SECONDS` (background commit interval, default 5; 0: only sync, fsync and
/// unmount commit). Returns the handle, or NULL with `*err` set: EINVAL for an
/// unknown option, the host's errno when the image cannot be reached (ENOENT...), EIO
/// for any other failure to open it.
#[no_mangle]
pub unsafe extern "C" fn pwfs_mount(
    image: *const c_char,
    image_len: size_t,
    options: *const c_char,
    options_len: size_t,
    err: *mut c_int,
) -> *mut pwfs_fs {
    call(err, std::ptr::null_mut(), || {
        // SAFETY: the caller's pointers and lengths (contract).
        let (image, opts) = unsafe { (host_path(image, image_len)?, bytes(options as *const c_void, options_len)?) };
        let config = mount_config(opts)?;
        // The engine reports any failure to open the device as EIO; a missing or
        // forbidden image is worth its own errno.
        std::fs::metadata(image).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        let fs = engine::mount_image(image, config).map_err(errno)?;
        Ok(Box::into_raw(Box::new(pwfs_fs { fs, open: Arc::new(AtomicUsize::new(0)) })))
    })
}

/// Write everything back, empty the journal, mark the image clean, release it and
/// free `fs`. Files and directories must be closed first: while any is open this
/// fails with EBUSY and `fs` stays valid. On any other outcome `fs` is freed, also
/// when the final flush failed (returns -1 with that error, EIO for example).
#[no_mangle]
pub unsafe extern "C" fn pwfs_unmount(fs: *mut pwfs_fs, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: a live handle (contract).
        let h = unsafe { handle(fs)? };
        if h.open.load(Ordering::Acquire) > 0 {
            return Err(libc::EBUSY);
        }
        // SAFETY: from `pwfs_mount`'s Box; the caller gives it up here.
        let h = unsafe { Box::from_raw(fs) };
        h.fs.unmount().map_err(errno)?;
        Ok(0)
    })
}

/// Make everything written so far durable (data, then a journal commit): sync(2)
/// for this image. Returns 0, or -1 with `*err` set.
#[no_mangle]
pub unsafe extern "C" fn pwfs_sync(fs: *mut pwfs_fs, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: a live handle (contract).
        unsafe { handle(fs)? }.fs.sync().map_err(errno)?;
        Ok(0)
    })
}

// ---- Names ----

/// Attributes of the file at `path`, following a symlink in the last component.
#[no_mangle]
pub unsafe extern "C" fn pwfs_stat(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    out: *mut pwfs_stat,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        let md = h.fs.metadata(p).map_err(errno)?;
        // SAFETY: as above.
        unsafe { put_stat(out, &md)? };
        Ok(0)
    })
}

/// As `pwfs_stat`, but a symlink in the last component is not followed.
#[no_mangle]
pub unsafe extern "C" fn pwfs_lstat(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    out: *mut pwfs_stat,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        let md = h.fs.symlink_metadata(p).map_err(errno)?;
        // SAFETY: as above.
        unsafe { put_stat(out, &md)? };
        Ok(0)
    })
}

/// mkdir(2): create the directory `path` with permission bits `mode` (no umask is
/// applied; owner 0:0).
#[no_mangle]
pub unsafe extern "C" fn pwfs_mkdir(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    mode: u32,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        h.fs.create_dir(p, mode & 0o7777).map_err(errno)?;
        Ok(0)
    })
}

/// rmdir(2).
#[no_mangle]
pub unsafe extern "C" fn pwfs_rmdir(fs: *mut pwfs_fs, path: *const c_char, path_len: size_t, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        h.fs.remove_dir(p).map_err(errno)?;
        Ok(0)
    })
}

/// unlink(2). An open file stays readable and writable through its handles until
/// the last is closed.
#[no_mangle]
pub unsafe extern "C" fn pwfs_unlink(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        h.fs.remove_file(p).map_err(errno)?;
        Ok(0)
    })
}

/// rename(2): `from` replaces `to` if it exists (and is compatible).
#[no_mangle]
pub unsafe extern "C" fn pwfs_rename(
    fs: *mut pwfs_fs,
    from: *const c_char,
    from_len: size_t,
    to: *const c_char,
    to_len: size_t,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, from, to) = unsafe { (handle(fs)?, path(from, from_len)?, path(to, to_len)?) };
        h.fs.rename_path(from, to).map_err(errno)?;
        Ok(0)
    })
}

// ---- Directories ----

/// Open the directory `path` for listing with `pwfs_readdir`. Free with
/// `pwfs_closedir`. ENOTDIR if it is not a directory.
#[no_mangle]
pub unsafe extern "C" fn pwfs_opendir(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    err: *mut c_int,
) -> *mut pwfs_dir {
    call(err, std::ptr::null_mut(), || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        // Held open, as the kernel holds a directory stream's inode: removed meanwhile,
        // it lists nothing; its number is not given to another directory.
        let held = OpenOptions::new().read(true).open(&h.fs, p).map_err(errno)?;
        if !held.metadata().map_err(errno)?.is_dir() {
            return Err(libc::ENOTDIR);
        }
        h.open.fetch_add(1, Ordering::AcqRel);
        let dir =
            pwfs_dir { fs: h.fs.clone(), held, next: 2, batch: Vec::new(), at: 0, done: false, open: h.open.clone() };
        Ok(Box::into_raw(Box::new(dir)))
    })
}

/// The next entry of `dir` ("." and ".." are not listed), in `*out`. Returns 1 for
/// an entry, 0 at the end, -1 with `*err` set. Entries added or removed while a
/// listing runs may or may not appear; the others appear exactly once.
#[no_mangle]
pub unsafe extern "C" fn pwfs_readdir(dir: *mut pwfs_dir, out: *mut pwfs_dirent, err: *mut c_int) -> c_int {
    call(err, -1, || {
        if dir.is_null() {
            return Err(libc::EINVAL);
        }
        if out.is_null() {
            return Err(libc::EFAULT);
        }
        // SAFETY: a live handle used by one thread at a time (contract).
        let d = unsafe { &mut *dir };
        if d.at == d.batch.len() {
            if d.done {
                return Ok(0);
            }
            let mut batch = d.fs.readdir(d.held.ino(), d.next, DIR_BATCH).map_err(errno)?;
            let Some(last) = batch.last() else {
                d.done = true;
                return Ok(0);
            };
            d.next = last.next;
            for e in &mut batch {
                e.name.push(0);
            }
            d.batch = batch;
            d.at = 0;
        }
        let e = &d.batch[d.at];
        d.at += 1;
        let entry = pwfs_dirent {
            ino: e.ino,
            name: e.name.as_ptr() as *const c_char,
            name_len: e.name.len() - 1,
            r#type: dirent_type(e.kind),
        };
        // SAFETY: `out` points at a `pwfs_dirent` the caller owns (contract).
        unsafe { out.write(entry) };
        Ok(1)
    })
}

/// Free `dir` (and the names `pwfs_readdir` handed out). Returns 0, or -1 with EINVAL
/// for NULL.
#[no_mangle]
pub unsafe extern "C" fn pwfs_closedir(dir: *mut pwfs_dir, err: *mut c_int) -> c_int {
    call(err, -1, || {
        if dir.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: from `pwfs_opendir`'s Box; the caller gives it up here.
        let d = unsafe { Box::from_raw(dir) };
        // The directory is let go of before the count says so: an unmount on another
        // thread that sees no handle finds nothing of this one left.
        let uncount = Uncount(d.open.clone());
        drop(d);
        drop(uncount);
        Ok(0)
    })
}

// ---- Files ----

/// Flags `pwfs_open` takes: the access mode, O_CREAT, O_EXCL, O_TRUNC, O_APPEND,
/// O_NOFOLLOW, O_DIRECTORY; O_CLOEXEC, O_NOCTTY and O_LARGEFILE mean nothing here and
/// are ignored. Any other bit (O_SYNC, O_DIRECT, O_PATH...) is EINVAL.
const OPEN_FLAGS: c_int = libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_EXCL
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_NOFOLLOW
    | libc::O_DIRECTORY
    | libc::O_CLOEXEC
    | libc::O_NOCTTY
    | libc::O_LARGEFILE;

fn open_options(flags: c_int, mode: u32) -> Res<OpenOptions> {
    if flags & !OPEN_FLAGS != 0 {
        return Err(libc::EINVAL);
    }
    let (read, write) = match flags & libc::O_ACCMODE {
        libc::O_RDONLY => (true, false),
        libc::O_WRONLY => (false, true),
        libc::O_RDWR => (true, true),
        _ => return Err(libc::EINVAL),
    };
    if flags & libc::O_DIRECTORY != 0 && flags & libc::O_CREAT != 0 {
        return Err(libc::EINVAL);
    }
    let mut o = OpenOptions::new();
    o.read(read)
        .write(write)
        // The engine's append implies write access; O_RDONLY|O_APPEND stays read-only.
        .append(write && flags & libc::O_APPEND != 0)
        .create(flags & libc::O_CREAT != 0)
        .create_new(flags & libc::O_CREAT != 0 && flags & libc::O_EXCL != 0)
        .truncate(flags & libc::O_TRUNC != 0)
        .nofollow(flags & libc::O_NOFOLLOW != 0)
        .mode(mode & 0o7777);
    Ok(o)
}

/// open(2): open (or create) the file at `path` with the host's `O_*` flags (the
/// access mode, O_CREAT, O_EXCL, O_TRUNC, O_APPEND, O_NOFOLLOW, O_DIRECTORY; O_CLOEXEC
/// and O_NOCTTY are ignored; any other flag is EINVAL). A created file gets the
/// permission bits `mode` (no umask is applied) and owner 0:0. The position starts at
/// 0. Free the handle with `pwfs_close`. Returns NULL with `*err` set on failure.
#[no_mangle]
pub unsafe extern "C" fn pwfs_open(
    fs: *mut pwfs_fs,
    path: *const c_char,
    path_len: size_t,
    flags: c_int,
    mode: u32,
    err: *mut c_int,
) -> *mut pwfs_file {
    call(err, std::ptr::null_mut(), || {
        // SAFETY: the caller's handle, pointers and lengths (contract).
        let (h, p) = unsafe { (handle(fs)?, self::path(path, path_len)?) };
        // O_DIRECTORY is checked before anything happens to the file (O_TRUNC), as
        // Linux refuses it at lookup.
        if flags & libc::O_DIRECTORY != 0 {
            match h.fs.metadata(p) {
                Ok(m) if !m.is_dir() => return Err(libc::ENOTDIR),
                Ok(_) => {}
                Err(e) if e.errno() == libc::ENOENT && flags & libc::O_CREAT != 0 => {}
                Err(e) => return Err(e.errno()),
            }
        }
        let file = open_options(flags, mode)?.open(&h.fs, p).map_err(errno)?;
        if flags & libc::O_DIRECTORY != 0 && !file.metadata().map_err(errno)?.is_dir() {
            return Err(libc::ENOTDIR);
        }
        h.open.fetch_add(1, Ordering::AcqRel);
        Ok(Box::into_raw(Box::new(pwfs_file { file, open: h.open.clone() })))
    })
}

/// close(2): free `file`. Returns -1 (EIO) if a write to the file was lost after it
/// had returned; the handle is freed all the same. Closing does not make data
/// durable: `pwfs_fsync` does.
#[no_mangle]
pub unsafe extern "C" fn pwfs_close(file: *mut pwfs_file, err: *mut c_int) -> c_int {
    call(err, -1, || {
        if file.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: from `pwfs_open`'s Box; the caller gives it up here.
        let f = unsafe { Box::from_raw(file) };
        let pwfs_file { file, open } = *f;
        let uncount = Uncount(open);
        let r = file.close();
        drop(uncount);
        r.map_err(errno)?;
        Ok(0)
    })
}

/// read(2) at the file position, advancing it. Returns the bytes read (0 at the end
/// of the file), or -1 with `*err` set (EBADF if not open for reading).
#[no_mangle]
pub unsafe extern "C" fn pwfs_read(file: *mut pwfs_file, buf: *mut c_void, len: size_t, err: *mut c_int) -> ssize_t {
    call(err, -1, || {
        // SAFETY: the caller's handle and buffer (contract).
        let (f, buf) = unsafe { (handle(file)?, bytes_mut(buf, len)?) };
        Ok(f.file.read(buf).map_err(errno)? as ssize_t)
    })
}

/// write(2) at the file position (at the end with O_APPEND), advancing it past what it
/// wrote. Returns the bytes written — `len`, or fewer, as write(2), when it ran out of
/// space, met a read error or reached the largest file size after writing some (call
/// again for the rest to get the error) — or -1 with `*err` set when it wrote nothing.
#[no_mangle]
pub unsafe extern "C" fn pwfs_write(file: *mut pwfs_file, buf: *const c_void, len: size_t, err: *mut c_int) -> ssize_t {
    call(err, -1, || {
        // SAFETY: the caller's handle and buffer (contract).
        let (f, buf) = unsafe { (handle(file)?, bytes(buf, len)?) };
        Ok(f.file.write(buf).map_err(errno)? as ssize_t)
    })
}

/// pread(2): read at `offset`; the file position does not move.
#[no_mangle]
pub unsafe extern "C" fn pwfs_pread(
    file: *mut pwfs_file,
    buf: *mut c_void,
    len: size_t,
    offset: u64,
    err: *mut c_int,
) -> ssize_t {
    call(err, -1, || {
        // SAFETY: the caller's handle and buffer (contract).
        let (f, buf) = unsafe { (handle(file)?, bytes_mut(buf, len)?) };
        Ok(f.file.read_at(buf, file_offset(offset)?).map_err(errno)? as ssize_t)
    })
}

/// pwrite(2): write `buf` at `offset` (at the end with O_APPEND, as Linux does); the
/// file position does not move. Returns the bytes written, short as `pwfs_write`'s
/// can be, or -1 with `*err` set.
#[no_mangle]
pub unsafe extern "C" fn pwfs_pwrite(
    file: *mut pwfs_file,
    buf: *const c_void,
    len: size_t,
    offset: u64,
    err: *mut c_int,
) -> ssize_t {
    call(err, -1, || {
        // SAFETY: the caller's handle and buffer (contract).
        let (f, buf) = unsafe { (handle(file)?, bytes(buf, len)?) };
        Ok(f.file.write_at(buf, file_offset(offset)?).map_err(errno)? as ssize_t)
    })
}

/// lseek(2) with SEEK_SET, SEEK_CUR, SEEK_END, SEEK_DATA or SEEK_HOLE. Returns the new
/// position, or -1 with `*err` set (EINVAL before the start, ENXIO for SEEK_DATA or
/// SEEK_HOLE at or past the end).
#[no_mangle]
pub unsafe extern "C" fn pwfs_lseek(file: *mut pwfs_file, offset: i64, whence: c_int, err: *mut c_int) -> i64 {
    use std::io::SeekFrom;
    call(err, -1, || {
        // SAFETY: the caller's handle (contract).
        let f = unsafe { handle(file)? };
        let to = match whence {
            libc::SEEK_SET => SeekFrom::Start(u64::try_from(offset).map_err(|_| libc::EINVAL)?),
            libc::SEEK_CUR => SeekFrom::Current(offset),
            libc::SEEK_END => SeekFrom::End(offset),
            libc::SEEK_DATA | libc::SEEK_HOLE => {
                let from = u64::try_from(offset).map_err(|_| libc::ENXIO)?;
                SeekFrom::Start(f.file.seek_hole_data(from, whence == libc::SEEK_HOLE).map_err(errno)?)
            }
            _ => return Err(libc::EINVAL),
        };
        let at = f.file.seek(to).map_err(errno)?;
        i64::try_from(at).map_err(|_| libc::EOVERFLOW)
    })
}

/// fsync(2): returns once the file's data and metadata, and every name change made
/// before, are durable.
#[no_mangle]
pub unsafe extern "C" fn pwfs_fsync(file: *mut pwfs_file, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle (contract).
        unsafe { handle(file)? }.file.sync_all().map_err(errno)?;
        Ok(0)
    })
}

/// fdatasync(2): returns once the file's data and size are durable.
#[no_mangle]
pub unsafe extern "C" fn pwfs_fdatasync(file: *mut pwfs_file, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle (contract).
        unsafe { handle(file)? }.file.sync_data().map_err(errno)?;
        Ok(0)
    })
}

/// ftruncate(2): set the file's size (EINVAL if not open for writing).
#[no_mangle]
pub unsafe extern "C" fn pwfs_ftruncate(file: *mut pwfs_file, size: u64, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle (contract).
        unsafe { handle(file)? }.file.set_len(file_offset(size)?).map_err(errno)?;
        Ok(0)
    })
}

/// fallocate(2): `mode` is 0 or `FALLOC_FL_*` bits (KEEP_SIZE, PUNCH_HOLE,
/// ZERO_RANGE, COLLAPSE_RANGE, INSERT_RANGE, as Linux takes them). EOPNOTSUPP for
/// others; EBADF if not open for writing.
#[no_mangle]
pub unsafe extern "C" fn pwfs_fallocate(
    file: *mut pwfs_file,
    mode: c_int,
    offset: u64,
    len: u64,
    err: *mut c_int,
) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle (contract).
        let f = unsafe { handle(file)? };
        let mode = u32::try_from(mode).map_err(|_| libc::EINVAL)?;
        f.file.allocate(mode, file_offset(offset)?, file_offset(len)?).map_err(errno)?;
        Ok(0)
    })
}

/// fstat(2): attributes of an open file, in `*out`.
#[no_mangle]
pub unsafe extern "C" fn pwfs_fstat(file: *mut pwfs_file, out: *mut pwfs_stat, err: *mut c_int) -> c_int {
    call(err, -1, || {
        // SAFETY: the caller's handle and `out` (contract).
        let f = unsafe { handle(file)? };
        let md = f.file.metadata().map_err(errno)?;
        // SAFETY: as above.
        unsafe { put_stat(out, &md)? };
        Ok(0)
    })
}

#[cfg(test)]
mod tests;
