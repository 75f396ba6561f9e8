//! The boundary's own rules, called from Rust: options, flags, NULL pointers, panics.
//! The whole ABI is exercised from C by `tests/c_abi.rs`.

use super::*;
use std::ptr::{null, null_mut};

#[test]
fn a_panic_becomes_eio() {
    let mut err = 0;
    let r = call(&mut err, -1, || -> Res<c_int> { panic!("a panic on purpose: a_panic_becomes_eio") });
    assert_eq!((r, err), (-1, libc::EIO));
    let r = call(&mut err, -1, || Ok(7));
    assert_eq!((r, err), (7, 0));
    // A NULL err is allowed.
    assert_eq!(call(null_mut(), -1, || Err(libc::ENOENT)), -1);
}

#[test]
fn null_handles_and_buffers() {
    let mut err = 0;
    unsafe {
        assert_eq!(pwfs_sync(null_mut(), &mut err), -1);
        assert_eq!(err, libc::EINVAL);
        assert_eq!(pwfs_unmount(null_mut(), &mut err), -1);
        assert_eq!(err, libc::EINVAL);
        assert_eq!(pwfs_close(null_mut(), &mut err), -1);
        assert_eq!(err, libc::EINVAL);
        assert_eq!(pwfs_closedir(null_mut(), &mut err), -1);
        assert_eq!(err, libc::EINVAL);
        assert_eq!(pwfs_read(null_mut(), null_mut(), 0, &mut err), -1);
        assert_eq!(err, libc::EINVAL);
        assert!(pwfs_mount(null(), 5, null(), 0, &mut err).is_null());
        assert_eq!(err, libc::EFAULT);
        assert!(pwfs_mount(null(), 0, null(), 0, &mut err).is_null());
        assert_eq!(err, libc::ENOENT);
        let with_nul = b"a\0b";
        assert!(pwfs_mount(with_nul.as_ptr() as *const c_char, 3, null(), 0, &mut err).is_null());
        assert_eq!(err, libc::EINVAL);
    }
    assert_eq!(unsafe { bytes(null(), 0) }, Ok(&[][..]));
    assert_eq!(unsafe { bytes(null(), 1) }, Err(libc::EFAULT));
}

#[test]
fn mount_options() {
    let c = mount_config(b"cache=64M,fetch=lazy,ro,check,atime,commit=0").unwrap();
    assert_eq!(c.cache_bytes, 64 << 20);
    assert_eq!(c.fetch, FetchPolicy::Lazy);
    assert!(c.read_only && c.atime);
    assert_eq!(c.check_on_mount, MountCheck::Always);
    assert_eq!(c.writeback_interval, None);
    let c = mount_config(b"").unwrap();
    assert_eq!(c.cache_bytes, Config::default().cache_bytes);
    assert_eq!(mount_config(b"commit=3").unwrap().writeback_interval, Some(Duration::from_secs(3)));
    for bad in [&b"cache"[..], b"cache=12Q", b"fetch=eager", b"bogus", b"ro=1", b"\xff"] {
        assert_eq!(mount_config(bad).err(), Some(libc::EINVAL), "{bad:?}");
    }
    let o = mkfs_options(b"inodes=4096,journal_blocks=512").unwrap();
    assert_eq!((o.inodes, o.journal_blocks), (Some(4096), Some(512)));
    assert_eq!(mkfs_options(b"inodes=x").err(), Some(libc::EINVAL));
}

#[test]
fn open_flags() {
    assert!(open_options(libc::O_RDONLY, 0).is_ok());
    assert!(open_options(libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o644).is_ok());
    assert_eq!(open_options(libc::O_ACCMODE, 0).err(), Some(libc::EINVAL));
    assert_eq!(open_options(libc::O_RDWR | libc::O_SYNC, 0).err(), Some(libc::EINVAL));
    assert_eq!(open_options(libc::O_RDWR | libc::O_DIRECT, 0).err(), Some(libc::EINVAL));
    assert_eq!(open_options(libc::O_DIRECTORY | libc::O_CREAT | libc::O_RDWR, 0).err(), Some(libc::EINVAL));
}

#[test]
fn stat_layout_has_no_padding() {
    assert_eq!(std::mem::size_of::<pwfs_stat>(), 3 * 8 + 3 * 8 + 10 * 4);
}

#[test]
fn offsets_past_int64_max_are_einval() {
    assert_eq!(file_offset(0), Ok(0));
    assert_eq!(file_offset(i64::MAX as u64), Ok(i64::MAX as u64));
    // An off_t of -1 converted to uint64_t, as a C caller's would be.
    assert_eq!(file_offset(-1i64 as u64), Err(libc::EINVAL));
    assert_eq!(file_offset(1 << 63), Err(libc::EINVAL));
}
