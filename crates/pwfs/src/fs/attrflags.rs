//! attrflags: the inode flags of FS_IOC_GETFLAGS/SETFLAGS (chattr/lsattr) that Patchwork
//! keeps — immutable, append-only, noatime — stored in the on-disk inode's flags with
//! the same bit values as Linux's FS_*_FL, and enforced here as the VFS does for local
//! file systems (a FUSE kernel does not know them, so the engine must).
//!
//! Interface: `Fs::get_flags`, `Fs::set_flags` (the caller checks privilege, as the
//! kernel's fileattr_set does: CAP_LINUX_IMMUTABLE for immutable and append-only, the
//! owner for the rest); `deny_change` and friends are called by the operations.

use super::inode::Inode;
use super::meta::now;
use super::Fs;
use crate::commit::Need;
use crate::error::{Error, Result};
use crate::format as f;

/// Linux's FS_IMMUTABLE_FL, FS_APPEND_FL, FS_NOATIME_FL.
pub const FS_IMMUTABLE_FL: u32 = 0x10;
pub const FS_APPEND_FL: u32 = 0x20;
pub const FS_NOATIME_FL: u32 = 0x80;
/// The flags a caller may see and set.
const USER_FLAGS: u32 = FS_IMMUTABLE_FL | FS_APPEND_FL | FS_NOATIME_FL;

/// EPERM for a change to an immutable or append-only inode (chmod, chown, explicit
/// times, truncate, unlink, rename, link, extended attributes): what may_delete and
/// notify_change refuse.
pub(crate) fn deny_change(node: &Inode) -> Result<()> {
    if node.d.flags & (f::INODE_FLAG_IMMUTABLE | f::INODE_FLAG_APPEND) != 0 {
        return Err(Error::not_permitted("the file is immutable or append-only"));
    }
    Ok(())
}

/// EPERM for any change to an immutable inode (a directory: no entry added or removed).
pub(crate) fn deny_immutable(node: &Inode) -> Result<()> {
    if node.d.flags & f::INODE_FLAG_IMMUTABLE != 0 {
        return Err(Error::not_permitted("the file is immutable"));
    }
    Ok(())
}

/// A write of `offset..` (`append`: at the end): none to an immutable file, only at
/// the end of an append-only one.
pub(crate) fn deny_write(node: &Inode, offset: u64, append: bool) -> Result<()> {
    deny_immutable(node)?;
    if node.d.flags & f::INODE_FLAG_APPEND != 0 && !append && offset != node.d.size {
        return Err(Error::not_permitted("the file is append-only"));
    }
    Ok(())
}

/// may_open's rule for chattr flags, for an open of a regular file: no write access to
/// an immutable file; to an append-only one only with O_APPEND, and no O_TRUNC.
pub(crate) fn deny_open(node: &Inode, write: bool, append: bool, truncate: bool) -> Result<()> {
    if write || truncate {
        deny_immutable(node)?;
    }
    if node.d.flags & f::INODE_FLAG_APPEND != 0 && ((write && !append) || truncate) {
        return Err(Error::not_permitted("the file is append-only: opened for writing without O_APPEND"));
    }
    Ok(())
}

impl Fs {
    /// May a descriptor opened without O_APPEND (`fd_append` false) write to `ino`?
    /// Not to an append-only file: EPERM, as the kernel's `may_open` refuses such an
    /// open on ext4. For front ends that learn of an open only at its first write
    /// (the FUSE mount without open requests); `deny_write` alone lets a write at the
    /// end through, which is right for O_APPEND descriptors only.
    pub fn check_fd_write(&self, ino: u64, fd_append: bool) -> Result<()> {
        if fd_append {
            return Ok(());
        }
        let cell = self.inner.cell(ino)?;
        if cell.kind != f::S_IFREG {
            return Ok(());
        }
        if cell.lock().d.flags & f::INODE_FLAG_APPEND != 0 {
            return Err(Error::not_permitted("the file is append-only and was not opened with O_APPEND"));
        }
        Ok(())
    }

    /// FS_IOC_GETFLAGS: the FS_*_FL flags of `ino`.
    pub fn get_flags(&self, ino: u64) -> Result<u32> {
        self.inner.check_up()?;
        let cell = self.inner.cell(ino)?;
        let node = cell.lock();
        if node.freed {
            return Err(Error::not_found(format!("inode {ino} is not in use")));
        }
        Ok(node.d.flags & USER_FLAGS)
    }

    /// FS_IOC_SETFLAGS: set the FS_*_FL flags of `ino` to `flags`. Flags Patchwork does
    /// not keep are EOPNOTSUPP (as ext4 for ones it lacks); the change time moves.
    pub fn set_flags(&self, ino: u64, flags: u32) -> Result<()> {
        self.inner.check_writable()?;
        if flags & !USER_FLAGS != 0 {
            return Err(Error::unsupported(format!("inode flags {:#x}", flags & !USER_FLAGS)));
        }
        let (mut m, ()) = self.inner.admitted(|m| Ok((Need::tx(m.inode_cost(ino, 0)?), ())))?;
        m.update(ino, |node| {
            node.d.flags = (node.d.flags & !USER_FLAGS) | flags;
            node.d.ctime = now();
        })?;
        drop(m);
        self.inner.maybe_commit();
        Ok(())
    }
}
