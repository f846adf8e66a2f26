package bench

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// plotLine is one series of the plot: its legend name, the median points
// (X block bytes, Y GB/s) and each point's min–max (nil: one run per point,
// no bars), and its dash pattern (nil: solid).
type plotLine struct {
	name   string
	pts    plotter.XYs
	lo, hi []float64
	dashes []vg.Length
}

// YError implements plotter.YErrorer: the bar from the minimum to the
// maximum repetition, relative to the median.
func (l plotLine) YError(i int) (float64, float64) { return l.pts[i].Y - l.lo[i], l.hi[i] - l.pts[i].Y }

// Len and XY implement plotter.XYer.
func (l plotLine) Len() int                    { return len(l.pts) }
func (l plotLine) XY(i int) (float64, float64) { return l.pts[i].X, l.pts[i].Y }

// plotLines returns the plot's series: one solid line per kvxfer transport
// and batch depth (and stream count when the run varied it; a dash-dot
// line for its READ cases), the median of
// the repetitions with min–max bars; one dashed line per peer series (one
// run per size, no bars); a dotted memcpy line (median, min–max) from each
// block size's shallowest shm case.
func plotLines(r *Report) []plotLine {
	type key struct {
		transport      string
		depth, streams int
		read           bool
	}
	byKey := map[key]*plotLine{}
	var order []key
	streamsVary := len(r.Method.Config.Streams) > 1
	reps := r.Method.Config.Reps
	memcpy := plotLine{name: "memcpy, 1 goroutine (shm working set; median, min–max)", dashes: []vg.Length{vg.Points(2), vg.Points(2)}}
	memcpyDepth := map[uint64]int{}
	for _, res := range r.Results {
		if res.Err != "" || res.GBps.Median <= 0 {
			continue
		}
		k := key{res.Transport, res.Depth, res.Streams, res.Read()}
		l := byKey[k]
		if l == nil {
			name := fmt.Sprintf("kvxfer %s, depth %d", res.Transport, res.Depth)
			if res.Read() {
				name = fmt.Sprintf("kvxfer %s READ, depth %d", res.Transport, res.Depth)
			}
			if streamsVary {
				name += fmt.Sprintf(", %d streams", res.Streams)
			}
			if reps > 1 {
				name += fmt.Sprintf(" (median of %d reps, min–max)", reps)
			}
			l = &plotLine{name: name}
			if res.Read() {
				l.dashes = []vg.Length{vg.Points(4), vg.Points(1), vg.Points(1), vg.Points(1)}
			}
			byKey[k] = l
			order = append(order, k)
		}
		l.pts = append(l.pts, plotter.XY{X: float64(res.BlockBytes), Y: res.GBps.Median})
		l.lo, l.hi = append(l.lo, res.GBps.Min), append(l.hi, res.GBps.Max)
		if res.Transport == "shm" && res.MemcpyGBps.Median > 0 && !res.Read() {
			if d, ok := memcpyDepth[res.BlockBytes]; !ok || res.Depth < d {
				if ok { // replace the deeper case's point
					for i := range memcpy.pts {
						if memcpy.pts[i].X == float64(res.BlockBytes) {
							memcpy.pts = append(memcpy.pts[:i], memcpy.pts[i+1:]...)
							memcpy.lo = append(memcpy.lo[:i], memcpy.lo[i+1:]...)
							memcpy.hi = append(memcpy.hi[:i], memcpy.hi[i+1:]...)
							break
						}
					}
				}
				memcpyDepth[res.BlockBytes] = res.Depth
				memcpy.pts = append(memcpy.pts, plotter.XY{X: float64(res.BlockBytes), Y: res.MemcpyGBps.Median})
				memcpy.lo, memcpy.hi = append(memcpy.lo, res.MemcpyGBps.Min), append(memcpy.hi, res.MemcpyGBps.Max)
			}
		}
	}
	var out []plotLine
	for _, k := range order {
		out = append(out, *byKey[k])
	}
	for _, t := range r.Method.Config.Transports {
		for _, label := range r.PeerLabels(t) {
			l := plotLine{name: shortPeer(label) + " (peer, one run per size)", dashes: []vg.Length{vg.Points(6), vg.Points(3)}}
			for _, pr := range r.Peers {
				if pr.Err == "" && pr.Label() == label && pr.GBps > 0 {
					l.pts = append(l.pts, plotter.XY{X: float64(pr.BlockBytes), Y: pr.GBps})
				}
			}
			out = append(out, l)
		}
	}
	out = append(out, memcpy)
	var kept []plotLine
	for _, l := range out {
		if len(l.pts) > 0 {
			l.sortByX()
			kept = append(kept, l)
		}
	}
	return kept
}

// sortByX orders the points (and their bars) by block size.
func (l *plotLine) sortByX() {
	idx := make([]int, len(l.pts))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return l.pts[idx[a]].X < l.pts[idx[b]].X })
	pts := make(plotter.XYs, len(idx))
	var lo, hi []float64
	for i, j := range idx {
		pts[i] = l.pts[j]
		if l.lo != nil {
			lo, hi = append(lo, l.lo[j]), append(hi, l.hi[j])
		}
	}
	l.pts, l.lo, l.hi = pts, lo, hi
}

// plotTitle is the plot's title: what is drawn, the machine and date, the
// load average at the start and end of the run, and a warning line when the
// load exceeded the machine's cores (other work competed for the CPUs, so
// the figures are noisy).
func plotTitle(r *Report) string {
	m := r.Method
	t := "kvxfer bench: bandwidth vs block size"
	if m.Config.Reps > 1 {
		t += fmt.Sprintf(" (median of %d reps, bars min–max)", m.Config.Reps)
	}
	if m.CPUModel != "" {
		t += fmt.Sprintf("\n%s, %d CPUs, %s", strings.TrimSpace(m.CPUModel), m.GOMAXPROCS, m.Date)
	}
	if m.LoadAvg != "" {
		t += "\nload average (1, 5, 15 min) " + m.LoadAvg + " at start"
		if m.LoadAvgEnd != "" {
			t += ", " + m.LoadAvgEnd + " at end"
		}
	}
	if load, at, cpus := m.loadExcess(); at != "" {
		t += fmt.Sprintf("\nWARNING: load %.2f > %d CPUs (%s of run): figures are noisy", load, cpus, at)
	}
	return t
}

// WritePlot draws bandwidth (GB/s) against block size (both axes
// logarithmic, plotLines: a line per kvxfer transport and depth with
// min–max bars, the peers dashed, memcpy dotted) under plotTitle, and saves
// it to path; the extension picks the format (.png, .svg, .pdf).
func WritePlot(r *Report, path string) error {
	ext := strings.ToLower(filepath.Ext(path))
	switch ext {
	case ".png", ".svg", ".pdf", ".jpg", ".jpeg":
	default:
		return fmt.Errorf("bench: plot file %q: want a .png or .svg name", path)
	}
	lines := plotLines(r)
	if len(lines) == 0 {
		return fmt.Errorf("bench: plot %s: no successful result to draw", path)
	}
	p := plot.New()
	p.Title.Text = plotTitle(r)
	p.X.Label.Text = "block size (bytes per WriteRequest)"
	p.Y.Label.Text = "GB/s (1e9 bytes/s)"
	p.X.Scale = plot.LogScale{}
	p.Y.Scale = plot.LogScale{}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())
	var sizes []uint64
	seen := map[uint64]bool{}
	lo, hi := math.Inf(1), 0.0
	for i, pl := range lines {
		l, s, err := plotter.NewLinePoints(pl.pts)
		if err != nil {
			return fmt.Errorf("bench: plot %s: %w", pl.name, err)
		}
		c := palette[i%len(palette)]
		l.Color, s.Color = c, c
		l.Width = vg.Points(1.8)
		l.Dashes = pl.dashes
		s.Shape = shapes[i%len(shapes)]
		s.Radius = vg.Points(3)
		p.Add(l, s)
		if pl.lo != nil {
			bars, err := plotter.NewYErrorBars(pl)
			if err != nil {
				return fmt.Errorf("bench: plot %s: error bars: %w", pl.name, err)
			}
			bars.Color, bars.Width, bars.CapWidth = c, vg.Points(1), vg.Points(4)
			p.Add(bars)
		}
		p.Legend.Add(pl.name, l, s)
		for j, pt := range pl.pts {
			if b := uint64(pt.X); !seen[b] {
				seen[b] = true
				sizes = append(sizes, b)
			}
			lo, hi = math.Min(lo, pt.Y), math.Max(hi, pt.Y)
			if pl.lo != nil {
				lo, hi = math.Min(lo, pl.lo[j]), math.Max(hi, pl.hi[j])
			}
		}
	}
	sort.Slice(sizes, func(i, j int) bool { return sizes[i] < sizes[j] })
	var ticks []plot.Tick
	for _, s := range sizes {
		ticks = append(ticks, plot.Tick{Value: float64(s), Label: FormatSize(s)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.X.Min = float64(sizes[0]) / 1.5
	p.X.Max = float64(sizes[len(sizes)-1]) * 1.5
	// Log Y: decades of ticks, headroom above the data for the legend.
	p.Y.Min = math.Pow(10, math.Floor(math.Log10(lo)))
	p.Y.Max = math.Pow(10, math.Ceil(math.Log10(hi))+0.2+0.12*float64(len(lines)))
	var yt []plot.Tick
	for v := p.Y.Min; v <= p.Y.Max*1.0001; v *= 10 {
		yt = append(yt, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', -1, 64)})
		for m := 2.0; m < 10; m++ {
			if v*m <= p.Y.Max {
				yt = append(yt, plot.Tick{Value: v * m})
			}
		}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(yt)
	if err := p.Save(10*vg.Inch, 7*vg.Inch, path); err != nil {
		return fmt.Errorf("bench: save plot %s: %w", path, err)
	}
	return nil
}

var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff},
	color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 0xff},
}

var shapes = []draw.GlyphDrawer{
	draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.CrossGlyph{},
	draw.PlusGlyph{}, draw.RingGlyph{}, draw.BoxGlyph{}, draw.PyramidGlyph{},
}
