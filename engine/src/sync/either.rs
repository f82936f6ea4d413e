//! One of two futures, chosen before either is polled.
//!
//! A function that does its synchronous work at the call and then returns
//! one future or another (the long stream, or the short refusal) returns
//! an [`Either`]: the chosen future is stored once, in place. An `async`
//! block that matched on a value and awaited one of its halves would store
//! the value as captured and again as the awaited future.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

pin_project_lite::pin_project! {
    /// A future that is `L` or `R`, both with the same output.
    #[project = EitherProj]
    #[derive(Debug)]
    pub enum Either<L, R> {
        /// The first kind.
        Left { #[pin] future: L },
        /// The second kind.
        Right { #[pin] future: R },
    }
}

impl<L, R> Either<L, R> {
    /// The first kind of future.
    pub fn left(future: L) -> Self {
        Either::Left { future }
    }

    /// The second kind of future.
    pub fn right(future: R) -> Self {
        Either::Right { future }
    }
}

impl<L, R> Future for Either<L, R>
where
    L: Future,
    R: Future<Output = L::Output>,
{
    type Output = L::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<L::Output> {
        match self.project() {
            EitherProj::Left { future } => future.poll(cx),
            EitherProj::Right { future } => future.poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    struct Noop;

    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }

    fn poll_once<F: Future>(future: F) -> Poll<F::Output> {
        let waker = Waker::from(Arc::new(Noop));
        let mut cx = Context::from_waker(&waker);
        let mut future = Box::pin(future);
        future.as_mut().poll(&mut cx)
    }

    #[test]
    fn each_side_polls_its_own_future() {
        let left: Either<_, std::future::Ready<u8>> = Either::left(async { 1u8 });
        let right: Either<std::future::Ready<u8>, _> = Either::right(async { 2u8 });
        assert_eq!(poll_once(left), Poll::Ready(1));
        assert_eq!(poll_once(right), Poll::Ready(2));
        let pending: Either<std::future::Pending<u8>, std::future::Ready<u8>> =
            Either::left(std::future::pending());
        assert_eq!(poll_once(pending), Poll::Pending);
    }

    #[test]
    fn it_is_as_large_as_its_larger_side_and_a_tag() {
        let big = async {
            let buf = [7u8; 512];
            std::future::ready(()).await;
            buf[511]
        };
        let size = std::mem::size_of_val(&big);
        let either: Either<_, std::future::Ready<u8>> = Either::left(big);
        assert!(std::mem::size_of_val(&either) <= size + 8);
    }
}
