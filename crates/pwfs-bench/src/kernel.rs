//! The kernel side of a comparison: plain files on the host file system (ext4 on
//! this disk), buffered or O_DIRECT, through pread/pwrite/fsync.

use pwfs::device::AlignedBuf;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

pub struct KFile {
    pub file: File,
    pub direct: bool,
}

fn check(n: isize, want: usize) -> io::Result<()> {
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != want {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("short transfer: {n} of {want}")));
    }
    Ok(())
}

impl KFile {
    pub fn open(path: &Path, direct: bool, create: bool) -> io::Result<KFile> {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(create).truncate(create);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        Ok(KFile { file: o.open(path)?, direct })
    }

    pub fn pread(&self, buf: &mut AlignedBuf, off: u64) -> io::Result<()> {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::pread(self.file.as_raw_fd(), buf.as_mut_ptr() as *mut _, buf.len(), off as i64) };
        check(n, buf.len())
    }

    pub fn pwrite(&self, buf: &AlignedBuf, off: u64) -> io::Result<()> {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::pwrite(self.file.as_raw_fd(), buf.as_ptr() as *const _, buf.len(), off as i64) };
        check(n, buf.len())
    }

    pub fn fsync(&self) -> io::Result<()> {
        self.file.sync_all()
    }

    /// Drop the kernel's cached pages of this file (cold start).
    pub fn drop_cache(&self) {
        // SAFETY: plain syscalls on an fd we own.
        unsafe {
            libc::fdatasync(self.file.as_raw_fd());
            libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}
