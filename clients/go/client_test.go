package mmcache

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// Unit tests: the client's encoding, decoding and fallback against local stand-ins
// (a closed port, httptest servers that fail on purpose). live_test.go runs the same
// calls against a real `mmcache serve`.

func newClient(t *testing.T, url string, opts ...Option) *Client {
	t.Helper()
	c, err := New(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func serve(t *testing.T, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s
}

// closedPort is an address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

func assertNoMatch(t *testing.T, resp *MatchResponse, endpoints ...string) {
	t.Helper()
	if resp == nil {
		t.Fatal("fallback answer is nil")
	}
	if len(resp.Endpoints) != len(endpoints) {
		t.Fatalf("fallback endpoints = %+v, want %v", resp.Endpoints, endpoints)
	}
	for i, e := range endpoints {
		m := resp.Endpoints[i]
		if m.Endpoint != e || m.Score != 0 || m.MatchedWeight != 0 || len(m.MatchedItems) != 0 {
			t.Fatalf("fallback entry %d = %+v, want %s with score 0", i, m, e)
		}
	}
}

func TestNewRefusesABadBaseURL(t *testing.T) {
	for _, u := range []string{"", "mmcache:8080", "ftp://x", "http://"} {
		if _, err := New(u); err == nil {
			t.Errorf("New(%q) accepted", u)
		}
	}
}

func TestMatchSendsTheContractBodyAndTokens(t *testing.T) {
	var got map[string]any
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/prefix/v1/match" {
			t.Errorf("%s %s", r.Method, r.URL.Path)
		}
		if a := r.Header.Get("Authorization"); a != "Bearer match-token" {
			t.Errorf("Authorization = %q", a)
		}
		if ct := r.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("Content-Type = %q", ct)
		}
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			t.Error(err)
		}
		io.WriteString(w, `{"request_items":[{"hash":"h","size":2,"modality":"image"}],
			"endpoints":[{"endpoint":"ns/a","matched_items":[{"hash":"h","size":2,"modality":"image"}],
			"matched_weight":2,"total_weight":2,"score":1.0,"future_field":true}]}`)
	})
	c := newClient(t, s.URL+"/prefix/", WithToken("write-token"), WithMatchToken("match-token"))
	resp, err := c.Match(context.Background(), MatchRequest{
		Endpoints: []string{"ns/a", "ns/b"},
		Body:      ChatCompletions([]byte(`{"messages":[]}`)),
		RequestID: "r-1",
	})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"body":{"chat_completions":{"messages":[]}},"endpoints":["ns/a","ns/b"],"request_id":"r-1"}`
	if raw, _ := json.Marshal(got); string(raw) != want {
		t.Errorf("sent %s, want %s", raw, want)
	}
	if resp.Score("ns/a") != 1 || resp.Score("ns/b") != 0 || resp.Endpoints[0].MatchedWeight != 2 {
		t.Errorf("decoded %+v", resp)
	}
	if resp.RequestItems[0] != (Item{Hash: "h", Size: 2, Modality: "image"}) {
		t.Errorf("request_items %+v", resp.RequestItems)
	}
}

func TestWritesUseTheWriteTokenAndDecodeEventsAccepted(t *testing.T) {
	var bodies []string
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		if a := r.Header.Get("Authorization"); a != "Bearer write-token" {
			t.Errorf("%s: Authorization = %q", r.URL.Path, a)
		}
		raw, _ := io.ReadAll(r.Body)
		bodies = append(bodies, r.URL.Path+" "+string(raw))
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, `{"events":2}`)
	})
	c := newClient(t, s.URL, WithToken("write-token"), WithMatchToken("match-token"))
	ctx := context.Background()
	for _, call := range []func() (*EventsAccepted, error){
		func() (*EventsAccepted, error) {
			return c.Place(ctx, PlacementRequest{Endpoints: []string{"ns/a"}, Items: []Item{{"h", 1, "image"}}})
		},
		func() (*EventsAccepted, error) {
			return c.Place(ctx, PlacementRequest{RequestID: "r", Endpoints: []string{"ns/a"}, Body: map[string]any{"messages": []any{}}})
		},
		func() (*EventsAccepted, error) {
			return c.Place(ctx, PlacementRequest{Endpoints: []string{"ns/a"}, Items: []Item{}})
		},
		func() (*EventsAccepted, error) { return c.DeleteEndpoint(ctx, "ns/a") },
		func() (*EventsAccepted, error) { return c.SyncEndpoints(ctx, nil) },
	} {
		got, err := call()
		if err != nil || got.Events != 2 {
			t.Fatalf("got %+v, %v", got, err)
		}
	}
	want := []string{
		`/v1/placements {"endpoints":["ns/a"],"items":[{"hash":"h","size":1,"modality":"image"}]}`,
		`/v1/placements {"request_id":"r","endpoints":["ns/a"],"body":{"messages":[]}}`,
		`/v1/placements {"endpoints":["ns/a"],"items":[]}`,
		`/v1/endpoint-events {"type":"deleted","endpoint":"ns/a"}`,
		`/v1/endpoint-events {"type":"sync","live":[]}`,
	}
	if strings.Join(bodies, "\n") != strings.Join(want, "\n") {
		t.Errorf("sent\n%s\nwant\n%s", strings.Join(bodies, "\n"), strings.Join(want, "\n"))
	}
}

func TestAnErrorAnswerIsATypedError(t *testing.T) {
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"error":{"code":"log_unavailable","message":"not acknowledged"}}`)
	})
	_, err := newClient(t, s.URL).DeleteEndpoint(context.Background(), "ns/a")
	var e *Error
	if !errors.As(err, &e) || e.Status != 503 || e.Code != "log_unavailable" || e.Message != "not acknowledged" {
		t.Fatalf("err = %#v", err)
	}
	if !e.NotAcknowledged() {
		t.Error("a 503 on a write is not NotAcknowledged()")
	}
}

func TestAnErrorAnswerThatIsNotJSONKeepsItsStatusAndText(t *testing.T) {
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadGateway)
		io.WriteString(w, "<html>bad gateway</html>")
	})
	_, err := newClient(t, s.URL).Match(context.Background(), MatchRequest{Body: map[string]any{}})
	var e *Error
	if !errors.As(err, &e) || e.Status != 502 || e.Code != "" || e.Message != "<html>bad gateway</html>" {
		t.Fatalf("err = %#v", err)
	}
}

func TestMatchOrNoneOnAClosedPort(t *testing.T) {
	c := newClient(t, closedPort(t))
	resp, err := c.MatchOrNone(context.Background(), MatchRequest{Endpoints: []string{"ns/a", "ns/b", "ns/a"}, Body: map[string]any{}})
	if err == nil {
		t.Fatal("no error from a closed port")
	}
	var e *Error
	if errors.As(err, &e) {
		t.Fatalf("a refused connection is not an HTTP answer: %v", err)
	}
	assertNoMatch(t, resp, "ns/a", "ns/b")
}

func TestMatchOrNoneOnA500(t *testing.T) {
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
		io.WriteString(w, `{"error":{"code":"internal_error","message":"boom"}}`)
	})
	resp, err := newClient(t, s.URL).MatchOrNone(context.Background(), MatchRequest{Endpoints: []string{"ns/a"}, Body: map[string]any{}})
	var e *Error
	if !errors.As(err, &e) || e.Status != 500 {
		t.Fatalf("err = %v", err)
	}
	assertNoMatch(t, resp, "ns/a")
}

func TestMatchOrNoneOnBadJSON(t *testing.T) {
	for _, answer := range []string{`not json`, `{}`, `{"request_items":[],"endpoints":[{"score":"high"}]}`} {
		s := serve(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, answer) })
		resp, err := newClient(t, s.URL).MatchOrNone(context.Background(), MatchRequest{Endpoints: []string{"ns/a"}, Body: map[string]any{}})
		if err == nil {
			t.Fatalf("answer %q accepted", answer)
		}
		assertNoMatch(t, resp, "ns/a")
	}
}

// slow answers after `delay` or when the client gives up, whichever comes first.
func slow(t *testing.T, delay time.Duration) *httptest.Server {
	return serve(t, func(w http.ResponseWriter, r *http.Request) {
		// reading the body lets the server notice the client hanging up
		io.Copy(io.Discard, r.Body)
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, `{"request_items":[],"endpoints":[]}`)
	})
}

func TestMatchOrNoneOnTheDefaultMatchTimeout(t *testing.T) {
	s := slow(t, 2*time.Second)
	c := newClient(t, s.URL, WithMatchTimeout(30*time.Millisecond))
	start := time.Now()
	resp, err := c.MatchOrNone(context.Background(), MatchRequest{Endpoints: []string{"ns/a"}, Body: map[string]any{}})
	elapsed := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want a deadline", err)
	}
	if elapsed > time.Second {
		t.Fatalf("gave up after %v, the timeout is 30ms", elapsed)
	}
	assertNoMatch(t, resp, "ns/a")
}

func TestTheContextDeadlineWinsWhenEarlier(t *testing.T) {
	s := slow(t, 2*time.Second)
	c := newClient(t, s.URL) // default write timeout: 3 s
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.DeleteEndpoint(ctx, "ns/a")
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > time.Second {
		t.Fatalf("err = %v after %v", err, time.Since(start))
	}
}

func TestTheDefaultTimeoutWinsWhenEarlier(t *testing.T) {
	s := slow(t, 2*time.Second)
	c := newClient(t, s.URL, WithWriteTimeout(30*time.Millisecond))
	start := time.Now()
	_, err := c.SyncEndpoints(context.Background(), []string{"ns/a"})
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > time.Second {
		t.Fatalf("err = %v after %v", err, time.Since(start))
	}
}

func TestScoresGivesEveryCandidateAScore(t *testing.T) {
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"request_items":[{"hash":"h","size":1,"modality":"image"},{"hash":"g","size":3,"modality":"video"}],
			"endpoints":[{"endpoint":"ns/a","matched_items":[{"hash":"g","size":3,"modality":"video"}],
			"matched_weight":3,"total_weight":4,"score":0.75},
			{"endpoint":"ns/b","matched_items":[],"matched_weight":0,"total_weight":4,"score":0.0}]}`)
	})
	scores, items, err := newClient(t, s.URL).Scores(context.Background(), []string{"ns/a", "ns/b", "ns/c"}, map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	if len(scores) != 3 || scores["ns/a"] != 0.75 || scores["ns/b"] != 0 || scores["ns/c"] != 0 {
		t.Errorf("scores = %v", scores)
	}
	if len(items) != 2 || items[1].Hash != "g" {
		t.Errorf("items = %v", items)
	}
	scores, items, err = newClient(t, closedPort(t)).Scores(context.Background(), []string{"ns/a"}, map[string]any{})
	if err == nil || len(scores) != 1 || scores["ns/a"] != 0 || len(items) != 0 {
		t.Errorf("fallback scores = %v, items = %v, err = %v", scores, items, err)
	}
}
