//! One anonymous, 2 MiB-aligned host mapping with `MADV_HUGEPAGE` advised.
//!
//! Owns: the mapping's lifetime. Pages are not touched here, so the thread that first writes a
//! page decides its NUMA node (first touch).
use crate::error::PoolError;

/// Alignment of the arena base and of its length: one x86-64 huge page (2 MiB).
pub const ARENA_ALIGN: usize = 2 << 20;

/// An owned, aligned, zero-initialised anonymous mapping.
pub struct Arena {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access is governed by the
// users (the pool writes only while loading, before it is shared).
unsafe impl Send for Arena {}
// SAFETY: as above; shared references only read, or write through raw pointers under the
// pool's documented rules.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `nbytes` (rounded up to 2 MiB) of zeroed memory aligned to 2 MiB.
    pub fn new(nbytes: usize) -> Result<Self, PoolError> {
        let len = nbytes.max(1).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        let map_len = len + ARENA_ALIGN;
        // SAFETY: anonymous private mapping, no file descriptor; result checked for MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(PoolError::Alloc {
                nbytes: len,
                source: std::io::Error::last_os_error(),
            });
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(ARENA_ALIGN);
        let head = aligned - start;
        let tail = map_len - head - len;
        // SAFETY: both ranges lie inside the mapping just created and are not used afterwards.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            // Advice only; failure (no THP support) is harmless.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Ok(Self {
            ptr: aligned as *mut u8,
            len,
        })
    }

    /// Base address (2 MiB aligned).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Mapped length in bytes (a multiple of 2 MiB).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an arena maps at least one huge page.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe exactly the mapping kept in `new`.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let a = Arena::new(3 << 20).unwrap();
        assert_eq!(a.ptr() as usize % ARENA_ALIGN, 0);
        assert_eq!(a.len(), 4 << 20);
        // SAFETY: inside the mapping.
        unsafe {
            assert_eq!(*a.ptr().add(a.len() - 1), 0);
            *a.ptr() = 7;
            assert_eq!(*a.ptr(), 7);
        }
    }
}
