package wait_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/internal/wait"
)

func TestClosed(t *testing.T) {
	c := make(chan struct{})
	if wait.Closed(c) {
		t.Fatal("an open channel reads as closed")
	}
	close(c)
	if !wait.Closed(c) {
		t.Fatal("a closed channel reads as open")
	}
}

func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if !wait.Sleep(context.Background(), time.Second) || time.Since(start) != time.Second {
			t.Fatalf("Sleep(1s) returned after %v", time.Since(start))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		start = time.Now()
		if wait.Sleep(ctx, time.Hour) || time.Since(start) != 100*time.Millisecond {
			t.Fatalf("Sleep(1h) under a 100 ms context: returned after %v", time.Since(start))
		}
	})
}

func TestUntil(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, stop := make(chan struct{}), make(chan struct{})
		start := time.Now()
		if wait.Until(c, start.Add(time.Second), nil) || time.Since(start) != time.Second {
			t.Fatalf("Until an open channel: true, or after %v", time.Since(start))
		}
		time.AfterFunc(200*time.Millisecond, func() { close(stop) })
		start = time.Now()
		if wait.Until(c, start.Add(time.Hour), stop) || time.Since(start) != 200*time.Millisecond {
			t.Fatalf("Until cut short by stop: true, or after %v", time.Since(start))
		}
		time.AfterFunc(300*time.Millisecond, func() { close(c) })
		start = time.Now()
		if !wait.Until(c, start.Add(time.Hour), nil) || time.Since(start) != 300*time.Millisecond {
			t.Fatalf("Until a channel closed at 300 ms: false, or after %v", time.Since(start))
		}
		if !wait.Until(c, start.Add(time.Hour), stop) {
			t.Fatal("Until a closed channel with stop closed: false")
		}
	})
}
