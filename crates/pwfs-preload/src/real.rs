//! The functions the shim stands in front of: the next definition after ours
//! (`dlsym(RTLD_NEXT)`, normally libc's), looked up once.

use libc::{c_char, c_int, c_long, c_uint, c_void, iovec, mode_t, off_t, size_t, ssize_t, FILE};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The address of the next definition of `name` (0 if there is none).
pub fn lookup(name: &std::ffi::CStr, cache: &AtomicUsize) -> usize {
    let p = cache.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: dlsym with a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    cache.store(p, Ordering::Relaxed);
    p
}

/// `real! { fail: name(args) -> ret; ... }`: each function's next definition, or
/// `fail` with errno ENOSYS when there is none.
macro_rules! real {
    ($fail:expr; $($name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty;)*) => {$(
        /// The next definition of the function of this name.
        ///
        /// # Safety
        /// The C function's own contract.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) -> $ret {
            static P: AtomicUsize = AtomicUsize::new(0);
            let p = lookup(
                // SAFETY: the literal ends with its NUL.
                std::ffi::CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()),
                &P,
            );
            if p == 0 {
                *libc::__errno_location() = libc::ENOSYS;
                return $fail;
            }
            let f: unsafe extern "C" fn($($ty),*) -> $ret = std::mem::transmute(p);
            f($($arg),*)
        }
    )*};
}

real! {
    -1 as _;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t;
    pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    preadv64(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t;
    pwritev64(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t;
    preadv64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t;
    pwritev64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int) -> ssize_t;
    lseek64(fd: c_int, off: off_t, whence: c_int) -> off_t;
    fsync(fd: c_int) -> c_int;
    fdatasync(fd: c_int) -> c_int;
    ftruncate64(fd: c_int, len: off_t) -> c_int;
    fallocate64(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int;
    posix_fallocate64(fd: c_int, off: off_t, len: off_t) -> c_int;
    fstat64(fd: c_int, st: *mut libc::stat64) -> c_int;
    fstatat64(dirfd: c_int, path: *const c_char, st: *mut libc::stat64, flags: c_int) -> c_int;
    statx(dirfd: c_int, path: *const c_char, flags: c_int, mask: c_uint, st: *mut libc::statx) -> c_int;
    syncfs(fd: c_int) -> c_int;
    close(fd: c_int) -> c_int;
    fclose(f: *mut FILE) -> c_int;
    dup(old: c_int) -> c_int;
    dup2(old: c_int, new: c_int) -> c_int;
    dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int;
    open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int;
    openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int;
    __open64_2(path: *const c_char, flags: c_int) -> c_int;
    __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int;
    creat64(path: *const c_char, mode: mode_t) -> c_int;
    execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execv(path: *const c_char, argv: *const *const c_char) -> c_int;
    execvp(file: *const c_char, argv: *const *const c_char) -> c_int;
    execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    posix_spawn(
        pid: *mut libc::pid_t,
        path: *const c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut c_char,
        envp: *const *mut c_char
    ) -> c_int;
    posix_spawnp(
        pid: *mut libc::pid_t,
        file: *const c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut c_char,
        envp: *const *mut c_char
    ) -> c_int;
    system(command: *const c_char) -> c_int;
    copy_file_range(fd_in: c_int, off_in: *mut off_t, fd_out: c_int, off_out: *mut off_t, len: size_t, flags: c_uint) -> ssize_t;
    sendfile64(out: c_int, fd_in: c_int, off: *mut off_t, count: size_t) -> ssize_t;
    splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: c_uint) -> ssize_t;
}

real! {
    std::ptr::null_mut();
    popen(command: *const c_char, mode: *const c_char) -> *mut FILE;
    mmap64(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void;
    fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE;
    freopen64(path: *const c_char, mode: *const c_char, f: *mut FILE) -> *mut FILE;
}
