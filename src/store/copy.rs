//! Verified copies between stores (the relay).

use super::{MULTIPART_THRESHOLD, Store};
use crate::error::{Error, Result};

impl Store {
    /// Copies object `key` of this store to the same key of `to`, checking
    /// its size and BLAKE3 against `expected` as the bytes pass: the copy
    /// becomes visible only when both matched (a mismatch is an
    /// [`Error::Integrity`] naming the object, and a multipart upload is
    /// aborted, so nothing is left under the key). Small objects are read
    /// whole (below [`MULTIPART_THRESHOLD`]); larger ones stream through as
    /// ranged reads, `ahead` parts of [`PART_SIZE`](super::PART_SIZE) read ahead and as many
    /// uploading: memory is about 2 × `ahead` × [`PART_SIZE`](super::PART_SIZE) per copy,
    /// whatever the object's size.
    pub async fn copy_verified(
        &self,
        to: &Store,
        key: &str,
        expected: (u64, &str),
        ahead: usize,
    ) -> Result<()> {
        use futures::StreamExt;
        let (size, blake3) = expected;
        let mismatch = |expected: String, actual: String| Error::Integrity {
            scope: format!("object {key} at `{}` (not copied)", self.url),
            expected,
            actual,
        };
        let missing = || Error::NotFound(format!("object `{key}` is missing from `{}`", self.url));
        if size > self.max_object_size {
            return Err(Error::TooLarge {
                key: key.to_string(),
                size,
                max: self.max_object_size,
            });
        }
        let found = self.head(key).await?.ok_or_else(missing)?;
        if found != size {
            return Err(mismatch(format!("{size} bytes"), format!("{found} bytes")));
        }
        let mut hasher = blake3::Hasher::new();
        if size < MULTIPART_THRESHOLD as u64 {
            let bytes = self.get_at_most(key, size).await?.ok_or_else(missing)?;
            if bytes.len() as u64 != size {
                return Err(mismatch(
                    format!("{size} bytes"),
                    format!("{} bytes", bytes.len()),
                ));
            }
            crate::digest::blake3_update(&mut hasher, &bytes);
            let got = hasher.finalize().to_hex();
            if got.as_str() != blake3 {
                return Err(mismatch(
                    format!("BLAKE3 {blake3}"),
                    format!("BLAKE3 {got}"),
                ));
            }
            return to.put(key, bytes).await;
        }
        let mut writer = to.multipart(&Self::path(key)?, key).await?;
        let mut parts = std::pin::pin!(self.read_parts(key, size, ahead));
        while let Some(piece) = parts.next().await {
            let piece = match piece {
                Ok(p) => p,
                Err(e) => {
                    writer.abort().await.ok();
                    return Err(e);
                }
            };
            crate::digest::blake3_update(&mut hasher, &piece);
            if let Err(e) = writer.wait_for_capacity(ahead.max(1)).await {
                writer.abort().await.ok();
                return Err(to.err("upload part", key, e));
            }
            writer.put(piece);
        }
        let got = hasher.finalize().to_hex();
        if got.as_str() != blake3 {
            writer.abort().await.ok();
            return Err(mismatch(
                format!("BLAKE3 {blake3}"),
                format!("BLAKE3 {got}"),
            ));
        }
        writer
            .finish()
            .await
            .map_err(|e| to.err("complete multipart upload", key, e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::store::PART_SIZE;

    #[tokio::test]
    async fn copy_verified_streams_large_objects_and_refuses_mismatches() {
        let (from, to) = (
            Store::open("memory://").unwrap(),
            Store::open("memory://").unwrap(),
        );
        // Above the multipart threshold, not a whole number of parts.
        let len = MULTIPART_THRESHOLD + PART_SIZE + 12345;
        let body: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let hash = blake3::hash(&body).to_hex().to_string();
        from.put("anchors/a", Bytes::from(body.clone()))
            .await
            .unwrap();
        from.put("deltas/d", Bytes::from_static(b"small"))
            .await
            .unwrap();
        let small = blake3::hash(b"small").to_hex().to_string();

        // A wrong hash or size: an Integrity error naming the object, and
        // nothing at the destination (the multipart upload was aborted).
        let wrong = blake3::hash(b"other").to_hex().to_string();
        for (key, size, h) in [
            ("anchors/a", len as u64, wrong.as_str()),
            ("anchors/a", len as u64 - 1, hash.as_str()),
            ("deltas/d", 5, wrong.as_str()),
        ] {
            let e = from
                .copy_verified(&to, key, (size, h), 2)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::Integrity { scope, .. } if scope.contains(key)),
                "{e}"
            );
            assert_eq!(to.head(key).await.unwrap(), None, "{key} left behind");
        }
        let e = from
            .copy_verified(&to, "deltas/none", (5, &small), 2)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "{e}");
        // Over the reader's limit: refused before any read, naming the key.
        let e = from
            .clone()
            .with_max_object_size(4)
            .copy_verified(&to, "deltas/d", (5, &small), 2)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::TooLarge { key, size: 5, max: 4 } if key == "deltas/d"),
            "{e}"
        );
        assert_eq!(to.head("deltas/d").await.unwrap(), None);

        from.copy_verified(&to, "anchors/a", (len as u64, &hash), 2)
            .await
            .unwrap();
        from.copy_verified(&to, "deltas/d", (5, &small), 2)
            .await
            .unwrap();
        assert_eq!(to.get("anchors/a").await.unwrap().unwrap(), body);
        assert_eq!(
            to.measure("anchors/a").await.unwrap(),
            Some((len as u64, hash))
        );
        assert_eq!(to.measure("deltas/d").await.unwrap(), Some((5, small)));
        assert_eq!(to.measure("nothing").await.unwrap(), None);
    }
}
